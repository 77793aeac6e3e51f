"""Small custom workloads shared by test modules (import as `from workloads import TINY`)."""

# a 3-shape workload in the custom-workload TOML format: an AdamW embedding and two Muon shapes
TINY = """name = "tiny"
[[matrices]]
name = "embed"
rows = 256
cols = 32
optimizer = "adamw"
[[matrices]]
name = "wq"
rows = 32
cols = 32
count = 2
[[matrices]]
name = "w_up"
rows = 32
cols = 96
count = 2
"""
