"""examples/ run as a user runs them: examples/train_hf.py under torchrun on 2 gloo ranks with a tiny Llama
config.json (FSDP2 + DMuon, loss falls, a sharded checkpoint resumes into a fresh model with the same
losses as the run that went on)."""

from __future__ import annotations

import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, vocab_size=512,
             max_position_embeddings=256, tie_word_embeddings=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_train_hf_trains_saves_and_resumes(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA))
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(_free_port()), str(ROOT / "examples" / "train_hf.py"), "--config", str(config),
           "--layers", "2", "--hidden", "32", "--vocab", "128", "--steps", "5", "--resume-steps", "2",
           "--ckpt", str(ckpt)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=140, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"^llama: [\d.]+M parameters \([\d.]+M on Muon\), 2 ranks, fsdp2-owner$", out, re.M), out
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", out, re.M)]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses), out
    assert losses[-1] < losses[0] - 0.2, losses  # the synthetic sequences are learnable
    found = re.findall(r"^step \d+ continued (\S+) resumed (\S+)$", out, re.M)
    pairs = [(float(a), float(b)) for a, b in found]
    assert len(pairs) == 2 and all(a == b for a, b in pairs), out  # printed to 6 digits: equal
    assert pairs[0][0] < losses[0]  # the resumed model is the trained one, not a fresh one
    assert "resume matches" in out and (ckpt / ".metadata").is_file()
