"""`chunkmem finetune`: the bundled default end to end, resume after a kill, and its error messages."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")
transformers = pytest.importorskip("transformers")

from chunkmem import cli, corpus, finetune  # noqa: E402
from chunkmem.rundir import RunDir  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--seq-len", "32", "--batch-size", "4", "--eval-every", "0"]


@pytest.fixture
def tiny_config(tmp_path: Path) -> str:
    """A GPT-2 config smaller than the bundled one, for tests that run several times."""
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=10, eos_token_id=10)
    config.save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny" / "config.json")


def weights(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(directory.glob("model-*.safetensors")):
        out.update(load_file(file))
    return out


def test_default_run_learns_and_writes_a_loadable_directory(tmp_path: Path) -> None:
    cfg = finetune.FinetuneConfig(output=str(tmp_path), steps=30, seq_len=64, eval_every=15)  # bundled model, text
    result = finetune.run(cfg)
    assert result.step == 30 and [s for s, _ in result.evals] == [15, 30]
    assert result.losses[-1] < result.losses[0] - 1.0  # bytes: ln(256) = 5.5 at the start
    assert result.evals[-1][1] < result.evals[0][1]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    model = result.model.eval()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert (tmp_path / "metrics.jsonl").exists() and RunDir(tmp_path).saved_steps() == [30]
    assert "held-out loss" in finetune.summary(cfg, result)


def test_resume_after_kill_reaches_the_same_weights(tmp_path: Path, tiny_config: str) -> None:
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    args = ["--model", tiny_config, *SMALL, "--steps", "16", "--save-every", "4", "--keep", "2"]
    child = subprocess.Popen([sys.executable, "-m", "chunkmem.cli", "finetune", "--output", str(killed), *args],
                             env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not (killed / "checkpoints" / "step-00000004" / "meta.json").exists():  # then kill at once
        assert child.poll() is None, child.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "no checkpoint within a minute"
        time.sleep(0.01)
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL  # killed mid-run, not finished
    assert not (killed / "model.safetensors.index.json").exists()
    assert cli.main(["finetune", "--output", str(killed), *args, "--resume"]) == 0
    assert cli.main(["finetune", "--output", str(straight), *args]) == 0
    resumed, reference = weights(killed), weights(straight)
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name
    assert len(RunDir(killed).saved_steps()) <= 2  # --keep


def test_stop_after_then_resume(tmp_path: Path, tiny_config: str) -> None:
    out = tmp_path / "out"
    args = ["finetune", "--output", str(out), "--model", tiny_config, *SMALL, "--steps", "6", "--save-every", "3"]
    assert cli.main([*args, "--stop-after", "3"]) == 0
    assert RunDir(out).saved_steps() == [3] and not (out / "config.json").exists()
    assert cli.main(args) == 2  # checkpoints present: must say --resume
    assert cli.main([*args, "--resume"]) == 0
    assert RunDir(out).saved_steps()[-1] == 6 and (out / "config.json").exists()


def test_llama_config_with_grad_ckpt_and_accumulation(tmp_path: Path) -> None:
    cfg = finetune.FinetuneConfig(model=str(ROOT / "examples" / "llama_config.json"), output=str(tmp_path),
                                  steps=2, seq_len=64, batch_size=2, grad_accum=2, grad_ckpt=True,
                                  dtype="bf16", eval_every=0)
    result = finetune.run(cfg)
    assert result.step == 2 and all(torch.isfinite(torch.tensor(result.losses)))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.dtype == torch.bfloat16


def word_tokenizer(directory: Path) -> Any:
    """A word-level tokenizer trained on the bundled text, saved as Hugging Face files (no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train([str(corpus.BUNDLED_TEXT)], trainers.WordLevelTrainer(vocab_size=200,
                                                                         special_tokens=["[UNK]", "[EOS]"]))
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="[EOS]")
    wrapped.save_pretrained(directory)
    return wrapped


def test_model_directory_tokenizer_is_used_and_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir, out = tmp_path / "model", tmp_path / "out"
    tokenizer = word_tokenizer(model_dir)
    transformers.GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                            bos_token_id=1, eos_token_id=1).save_pretrained(model_dir)
    seen = []
    load = corpus.load
    monkeypatch.setattr(corpus, "load", lambda *a, **k: seen.append(load(*a, **k)) or seen[-1])
    cfg = finetune.FinetuneConfig(model=str(model_dir), output=str(out), steps=2, seq_len=16, batch_size=4,
                                  eval_every=0)
    assert finetune.run(cfg).step == 2
    data = seen[0]
    assert data.tokenizer == type(transformers.AutoTokenizer.from_pretrained(model_dir)).__name__ != "bytes"
    expected = tokenizer(corpus.BUNDLED_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert data.train.flatten()[:64].tolist() == expected[:64]  # words, not bytes
    assert int(data.train.max()) < len(tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (model_dir / name).read_bytes()
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded("Alice was beginning")["input_ids"] == tokenizer("Alice was beginning")["input_ids"]
    assert transformers.AutoModelForCausalLM.from_pretrained(out).config.vocab_size == len(tokenizer)


def test_keeps_exactly_the_last_checkpoints_and_logs_perplexity(tmp_path: Path, tiny_config: str) -> None:
    cfg = finetune.FinetuneConfig(model=tiny_config, output=str(tmp_path), steps=7, seq_len=32, batch_size=4,
                                  save_every=2, keep=2, eval_every=3, eval_batches=2)
    result = finetune.run(cfg)
    # Saves at 2, 4 and 6, and the final one at 7; only the newest two are left, nothing half-written.
    assert RunDir(tmp_path).saved_steps() == [6, 7]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000006", "step-00000007"]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [3, 6, 7] == [step for step, _ in result.evals]
    for record, (_, loss) in zip(evals, result.evals):
        assert record["eval_loss"] == loss
        assert record["eval_perplexity"] == pytest.approx(math.exp(record["eval_loss"]), rel=1e-12)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 8))


def test_cli_smoke(tmp_path: Path) -> None:
    command = Path(sys.executable).parent / "chunkmem"  # the installed entry point, beside this python
    argv = [str(command)] if command.exists() else [sys.executable, "-m", "chunkmem.cli"]
    done = subprocess.run([*argv, "finetune", "--steps", "3", "--output", str(tmp_path / "out")],
                          env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained steps 1-3 of 3" in done.stdout and "Hugging Face directory" in done.stdout
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == "GPT2LMHeadModel" and loaded.config.n_layer == 4  # the bundled default


def run_cli(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    code = cli.main(["finetune", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("args, expected", [
    (["--model", "/no/such/model"], "--model /no/such/model: no such directory"),
    (["--data", "/no/such/text.txt"], "--data /no/such/text.txt: no such file"),
    (["--seq-len", "4096"], "--seq-len 4096 exceeds the model's maximum of 256"),
    (["--device-memory", "4KiB"], "raise device_memory"),
    (["--batch-size", "0"], "--batch-size 0: expected a positive integer"),
])
def test_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], expected: str) -> None:
    code, err = run_cli(capsys, "--output", str(tmp_path / "out"), *args)
    assert code == 2
    assert expected in err


def test_unreadable_data_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    binary = tmp_path / "data.txt"
    binary.write_bytes(b"\xff\xfe\x00 not utf-8 \xc3")
    code, err = run_cli(capsys, "--output", str(tmp_path / "out"), "--data", str(binary))
    assert code == 2 and f"--data {binary}: cannot be read as UTF-8" in err
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text('{"body": "no text field"}\n')
    code, err = run_cli(capsys, "--output", str(tmp_path / "out"), "--data", str(jsonl))
    assert code == 2 and "--text-field" in err
