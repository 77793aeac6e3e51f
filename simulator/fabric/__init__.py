"""What it runs on: hardware profiles, cluster files, and closed-form collective costs."""
