"""`chunkmem env`: every line present, the bandwidth probe skipped clearly without CUDA."""

from __future__ import annotations

import json

import torch

from chunkmem.cli import main


def test_env_json(capsys) -> None:
    assert main(["env", "--json", "--probe-mib", "8"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"] == torch.__version__
    assert "GiB" in info["host RAM"] and info["locked-memory limit"]
    if not torch.cuda.is_available():
        assert info["pinned copy bandwidth"].startswith("skipped: no CUDA device")
    else:
        assert "GB/s" in info["pinned copy bandwidth"]


def test_env_bad_probe(capsys) -> None:
    assert main(["env", "--probe-mib", "0"]) == 2
    assert "--probe-mib 0" in capsys.readouterr().err
