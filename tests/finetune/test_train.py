"""`chunkmem finetune`: the bundled default end to end, resume after a kill, and its error messages."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
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

from safetensors.torch import load_file  # noqa: E402

from chunkmem import cli
from chunkmem.finetune import corpus
from chunkmem.finetune.corpus import read_documents  # noqa: E402
from chunkmem.finetune.hf import InputError  # noqa: E402
from chunkmem.finetune import train as finetune  # noqa: E402
from chunkmem.finetune.report import over_budget, summary  # noqa: E402
from chunkmem.finetune.rundir import RunDir  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
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
    assert "held-out loss" in summary(result)


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
    out, data = tmp_path / "out", tmp_path / "data.txt"
    text = corpus.BUNDLED_TEXT.read_text(encoding="utf-8")
    data.write_text(text, encoding="utf-8")
    args = ["finetune", "--output", str(out), "--model", tiny_config, "--data", str(data), *SMALL, "--steps", "6",
            "--save-every", "3"]
    assert cli.main([*args, "--stop-after", "3"]) == 0
    assert RunDir(out).saved_steps() == [3] and not (out / "config.json").exists()
    assert cli.main(args) == 2  # checkpoints present: must say --resume
    assert cli.main([*args, "--resume", "--max-grad-norm", "0.01"]) == 2  # it changes the result: was accepted
    data.write_text(text.replace("the", "a"), encoding="utf-8")  # edited between the runs: was accepted
    assert cli.main([*args, "--resume"]) == 2
    data.write_text(text, encoding="utf-8")
    config = Path(tiny_config).read_text()
    Path(tiny_config).write_text(config.replace('"gelu_new"', '"relu"'))  # edited between the runs: was accepted
    assert cli.main([*args, "--resume"]) == 2
    Path(tiny_config).write_text(config)
    assert cli.main([*args, "--resume"]) == 0
    assert RunDir(out).saved_steps()[-1] == 6 and (out / "config.json").exists()
    metrics = (out / "metrics.jsonl").read_text()
    assert "eval_loss" in metrics
    assert cli.main([*args, "--resume"]) == 0  # finished: nothing to do
    assert (out / "metrics.jsonl").read_text() == metrics  # it evaluated the last step again, logged twice


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


def test_a_tokenizer_whose_ids_pass_the_models_vocabulary_is_refused(tmp_path: Path) -> None:
    # Its ids index past the embedding: an IndexError mid-training (a device-side assert on a GPU).
    tokenizer = word_tokenizer(tmp_path / "model")
    with pytest.raises(finetune.InputError, match=f"gives the data id .*vocab_size is {len(tokenizer) - 5}"):
        corpus.tokenize([corpus.BUNDLED_TEXT.read_text(encoding="utf-8")], tokenizer, len(tokenizer) - 5)
    assert int(corpus.tokenize(["Alice was beginning"], tokenizer, len(tokenizer)).max()) < len(tokenizer)


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
    (["--device-memory", "4KiB"], "--device-memory allows 4096: raise --device-memory above"),
    (["--host-memory", "1KiB"], "--host-memory allows 1024: raise --host-memory, use a lower-precision --dtype\n"),
    (["--batch-size", "0"], "--batch-size 0: expected a positive integer"),
    (["--chunk-size", "7"], "set --chunk-size to at least 32768"),
    (["--lr", "nan"], "--lr nan: expected a positive finite learning rate"),
    (["--lr", "-1"], "--lr -1.0: expected a positive finite learning rate"),  # named --epochs None too
    (["--epochs", "inf"], "--epochs inf: expected a positive finite number of passes"),  # an OverflowError
    (["--weight-decay", "nan"], "--weight-decay nan: expected 0"),  # trained on NaN
    (["--stop-after", "0"], "--stop-after 0: expected a positive number of steps"),  # "had finished", and no checkpoint
    (["--seq-len", "1"], "--seq-len 1: expected 2 or more"),  # nothing to predict: NaN losses
    (["--device", "tpu"], "--device='tpu': expected"),  # a traceback from the default's budget, before the check
    (["--max-grad-norm", "-1"], "--max-grad-norm -1.0: expected 0 (no clipping) or more"),
    (["--lora-rank", "4", "--lora-alpha", "-3"], "--lora-alpha -3.0: expected a positive scale"),  # was accepted
])
def test_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture, args: list[str], expected: str) -> None:
    code, err = run_cli(capsys, "--output", str(tmp_path / "out"), *args)
    assert code == 2
    assert expected in err


def test_an_output_over_the_model_and_weights_of_unknown_layout_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture, tiny_config: str) -> None:
    model = Path(tiny_config).parent  # writing the output there replaced the model being read
    code, err = run_cli(capsys, "--output", str(model), "--model", str(model))
    assert code == 2 and "is the --model folder" in err
    code, err = run_cli(capsys, "--output", tiny_config, "--model", str(model))  # a traceback (FileExistsError)
    assert code == 2 and "is a file: expected a folder" in err
    code, err = run_cli(capsys, "--output", str(model), "--model", tiny_config)  # its config.json named
    assert code == 2 and "is the --model folder" in err
    other = tmp_path / "other-model"  # another model's folder: its shards and config were replaced
    shutil.copytree(model, other)
    code, err = run_cli(capsys, "--output", str(other), "--model", str(model))
    assert code == 2 and "holds a model no chunkmem finetune run wrote (config.json)" in err
    (other / "config.json").unlink()
    (other / "tokenizer.json").write_text("{}")  # another run's tokenizer, under another tool's run.json (Sacred's)
    (other / "run.json").write_text(json.dumps({"experiment": {"name": "x"}, "status": "COMPLETED"}))
    code, err = run_cli(capsys, "--output", str(other), "--model", str(model))
    assert code == 2 and "holds a model no chunkmem finetune run wrote (tokenizer.json)" in err
    (other / "run.json").write_text("")  # unreadable, with no checkpoint of ours beside it: not ours
    code, err = run_cli(capsys, "--output", str(other), "--model", str(model))
    assert code == 2 and "holds a model no chunkmem finetune run wrote (tokenizer.json)" in err
    (model / "model-00001-of-00002.safetensors").write_bytes(b"")  # shards whose index is gone: random weights
    code, err = run_cli(capsys, "--output", str(tmp_path / "out"), "--model", str(model))
    assert code == 2 and "model-00001-of-00002.safetensors without model.safetensors.index.json" in err


def test_a_damaged_model_folder_and_a_config_that_makes_no_model_are_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture, tiny_config: str) -> None:
    model = Path(tiny_config).parent
    config = json.loads(Path(tiny_config).read_text())
    Path(tiny_config).write_text(json.dumps(config | {"n_embd": 30, "n_head": 4}))  # 4 heads do not divide 30
    code, err = run_cli(capsys, "--output", str(tmp_path / "o1"), "--model", str(model), "--seq-len", "32")
    assert code == 2 and "its config does not make a model" in err
    Path(tiny_config).write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"\x10" * 100)  # cut short (SafetensorError)
    code, err = run_cli(capsys, "--output", str(tmp_path / "o2"), "--model", str(model), "--seq-len", "32")
    assert code == 2 and "model.safetensors: not a readable safetensors file" in err
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text('{"weight_map": {"wte.weight": "model-1.safetensors"')
    code, err = run_cli(capsys, "--output", str(tmp_path / "o3"), "--model", str(model), "--seq-len", "32")
    assert code == 2 and "not a safetensors index" in err  # JSONDecodeError
    (model / "model.safetensors.index.json").write_text('{"weight_map": {"wte.weight": "model-1.safetensors"}}')
    code, err = run_cli(capsys, "--output", str(tmp_path / "o4"), "--model", str(model), "--seq-len", "32")
    assert code == 2 and "model-1.safetensors: not a readable safetensors file" in err  # FileNotFoundError


def test_unreadable_data_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    binary = tmp_path / "data.txt"
    binary.write_bytes(b"\xff\xfe\x00 not utf-8 \xc3")
    code, err = run_cli(capsys, "--output", str(tmp_path / "out"), "--data", str(binary))
    assert code == 2 and f"--data {binary}: cannot be read as UTF-8" in err
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text('{"body": "no text field"}\n')
    code, err = run_cli(capsys, "--output", str(tmp_path / "out"), "--data", str(jsonl))
    assert code == 2 and "--text-field" in err


def test_json_arrays_and_byte_order_marks_read_as_hugging_faces_json_loader_reads_them(tmp_path: Path) -> None:
    # A .json array was trained on as raw text (brackets, keys and all); a .jsonl a Windows editor saved with a
    # byte-order mark was refused ("line 1 is not JSON").
    records = [{"text": "first document"}, {"text": "second", "id": 2}]
    lines = "".join(json.dumps(r) + "\n" for r in records)
    files = {"array.json": json.dumps(records, indent=2), "lines.json": lines, "one.json": json.dumps(records[0]),
             "marked.jsonl": "\ufeff" + lines, "marked.txt": "\ufeffplain text",
             "separated.json": json.dumps({"text": "a\u2028b"}, ensure_ascii=False)}  # refused: "holds a JSON object"
    for name, text in files.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    expected = [r["text"] for r in records]
    for name in ("array.json", "lines.json", "marked.jsonl"):
        assert read_documents(tmp_path / name) == expected, name
    assert read_documents(tmp_path / "one.json") == expected[:1]
    assert read_documents(tmp_path / "marked.txt") == ["plain text"]
    assert read_documents(tmp_path / "separated.json") == ["a\u2028b"]
    (tmp_path / "nested.json").write_text(json.dumps({"data": records}, indent=2))
    with pytest.raises(InputError, match="holds a JSON object; a .json file holds an array of objects"):
        read_documents(tmp_path / "nested.json")
    (tmp_path / "bad.json").write_text(json.dumps([{"text": "ok"}, {"body": "none"}]))
    with pytest.raises(InputError, match="record 1 has no string field 'text'"):
        read_documents(tmp_path / "bad.json")
    (tmp_path / "x.ndjson").write_text(lines)  # was trained on as raw text, braces and keys included
    assert read_documents(tmp_path / "x.ndjson") == expected
    errors = {'["a", "b"]': "record 0 is a JSON string; expected an object with a string field 'text'",
              json.dumps(records, indent=2)[:-2] + ",\n]": "not JSON at line 9, column 1",  # said "line 1", of .jsonl
              "[" + "1" * 5000 + "]": "cannot be read as JSON",  # a traceback
              "null": "holds a JSON null"}
    for text, message in errors.items():
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(InputError, match=re.escape(message)):
            read_documents(tmp_path / "bad.json")


# -- interrupts, resumes, output, summaries (issue 15; issue 12 items 7, 12) -----------------------------

THREADS = ["--threads", "1"]  # a straight run and a resumed one must sum in the same order


def launch(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "chunkmem.cli", "finetune", "--output", str(out), *args],
                            env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_steps(child: subprocess.Popen, out: Path, steps: int) -> None:
    deadline = time.monotonic() + 120
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count('"loss"') >= steps):
        assert child.poll() is None, child.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"fewer than {steps} steps within two minutes"
        time.sleep(0.005)


def logged_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Arguments of a 40-step run on a tiny model, and the weights it ends with when nothing stops it."""
    root = tmp_path_factory.mktemp("straight")
    transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=10,
                            eos_token_id=10).save_pretrained(root / "tiny")
    args = ["--model", str(root / "tiny" / "config.json"), *SMALL, "--steps", "40", "--warmup-steps", "2", *THREADS]
    assert cli.main(["finetune", "--output", str(root / "out"), *args]) == 0
    return args, weights(root / "out")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_where_it_stops_and_the_printed_command_resumes(
        tmp_path: Path, straight: tuple[list[str], dict[str, torch.Tensor]], signum: int) -> None:
    """Issue 15, items 1-3: the first signal finishes the step, saves, prints one line (no traceback)
    and exits 128 + signal; the command it prints continues to the weights of a run never stopped,
    and metrics.jsonl holds every step once."""
    args, reference = straight
    out = tmp_path / "out"
    child = launch(out, *args)
    wait_for_steps(child, out, 3)
    child.send_signal(signum)
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 128 + signum, stderr[-2000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if "interrupted at step" in line]
    assert len(lines) == 1, stderr[-2000:]
    step = int(lines[0].split("interrupted at step ")[1].split()[0])
    assert 3 <= step < 40 and RunDir(out).saved_steps()[-1] == step
    assert logged_steps(out) == list(range(1, step + 1))
    command = lines[0].split("resume with: ")[1]
    argv = shlex.split(command)
    assert argv[:2] == ["chunkmem", "finetune"] and "--resume" in argv
    assert cli.main(argv[1:]) == 0
    assert logged_steps(out) == list(range(1, 41))
    resumed = weights(out)
    assert resumed.keys() == reference.keys()
    for name in reference:
        assert torch.equal(resumed[name], reference[name]), name


def test_a_second_signal_aborts_without_a_traceback(tmp_path: Path, tiny_config: str) -> None:
    out = tmp_path / "out"
    child = launch(out, "--model", tiny_config, *SMALL, "--steps", "100000", *THREADS)
    wait_for_steps(child, out, 2)
    child.send_signal(signal.SIGINT)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=120)
    assert child.returncode == 128 + signal.SIGINT, stderr[-2000:]
    assert "Traceback" not in stderr and ("aborted" in stderr or "interrupted at step" in stderr), stderr[-2000:]


def test_stop_after_saves_the_step_it_stops_at(tmp_path: Path, straight: tuple[list[str], dict[str, torch.Tensor]],
                                               capsys: pytest.CaptureFixture) -> None:
    """Issue 15, item 3: --stop-after 25 with --save-every 20 used to leave step 20 and say "resumable"."""
    args, reference = straight
    out = tmp_path / "out"
    base = ["finetune", "--output", str(out), *args, "--save-every", "20", "--keep", "5"]
    assert cli.main([*base, "--stop-after", "25"]) == 0
    assert RunDir(out).saved_steps() == [20, 25]
    assert "resume with:" in capsys.readouterr().out
    assert cli.main([*base, "--resume", "--stop-after", "7"]) == 0  # 26-32
    assert RunDir(out).saved_steps() == [20, 25, 32]
    assert cli.main([*base, "--resume"]) == 0
    assert logged_steps(out) == list(range(1, 41))  # each step once, however many invocations
    assert all(torch.equal(weights(out)[k], v) for k, v in reference.items())


def test_resume_needs_a_checkpoint_and_resume_or_start_does_either(tmp_path: Path, tiny_config: str,
                                                                   capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    args = ["finetune", "--output", str(out), "--model", tiny_config, *SMALL, "--steps", "3"]
    code, err = cli.main([*args, "--resume"]), capsys.readouterr().err
    assert code == 2 and "no checkpoint" in err and "--resume-or-start" in err
    assert not (out / "run.json").exists()
    assert cli.main([*args, "--resume-or-start", "--stop-after", "2"]) == 0
    assert RunDir(out).saved_steps() == [2]
    assert cli.main([*args, "--resume-or-start"]) == 0
    assert logged_steps(out) == [1, 2, 3] and (out / "config.json").exists()


def test_a_start_over_drops_the_metrics_of_the_run_it_replaces(tmp_path: Path, tiny_config: str) -> None:
    out = tmp_path / "out"
    args = ["finetune", "--output", str(out), "--model", tiny_config, *SMALL, "--steps", "3", "--save-minutes", "0"]
    (out).mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 9.0}\n{"ste')  # killed
    assert cli.main(args) == 0
    assert logged_steps(out) == [1, 2, 3] and all(json.loads(line)["loss"] != 9.0 for line in
                                                  (out / "metrics.jsonl").read_text().splitlines()[:2])


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "no tensor file"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(
        tmp_path: Path, straight: tuple[list[str], dict[str, torch.Tensor]], damage: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 15, item 4: a damaged newest checkpoint used to stop the resume with a raw SafetensorError."""
    args, reference = straight
    out = tmp_path / "out"
    base = ["finetune", "--output", str(out), *args, "--save-every", "10", "--keep", "3"]
    assert cli.main([*base, "--stop-after", "30"]) == 0
    assert RunDir(out).saved_steps() == [10, 20, 30]
    newest = out / "checkpoints" / "step-00000030"
    tensors = newest / "state.safetensors"
    data = bytearray(tensors.read_bytes())
    if damage == "flipped byte":
        data[-100] ^= 0x01
        tensors.write_bytes(bytes(data))
    elif damage == "truncated":
        tensors.write_bytes(bytes(data[:len(data) // 3]))
    else:
        tensors.unlink()
    (out / "checkpoints" / "step-00000031.tmp").mkdir()  # a save killed half-way
    with caplog.at_level("WARNING", logger="chunkmem"):
        assert cli.main([*base, "--resume"]) == 0
    assert "step-00000030 is damaged" in caplog.text and "state.safetensors" in caplog.text
    assert (out / "checkpoints" / "step-00000030.damaged").is_dir()
    assert not list((out / "checkpoints").glob("*.tmp"))
    assert logged_steps(out) == list(range(1, 41))
    assert all(torch.equal(weights(out)[k], v) for k, v in reference.items())


def test_every_checkpoint_damaged_is_a_clear_error(tmp_path: Path, tiny_config: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    args = ["finetune", "--output", str(out), "--model", tiny_config, *SMALL, "--steps", "4", "--save-every", "2"]
    assert cli.main([*args, "--stop-after", "2"]) == 0
    (out / "checkpoints" / "step-00000002" / "state.safetensors").write_bytes(b"\0" * 10)
    code, err = cli.main([*args, "--resume"]), capsys.readouterr().err
    assert code == 2 and "every checkpoint" in err and "damaged" in err and "Traceback" not in err


def test_the_output_has_a_tokenizer_that_round_trips_and_generates(tmp_path: Path) -> None:
    """Issue 15, item 5: the default run wrote no tokenizer, so from_pretrained + generate failed."""
    cfg = finetune.FinetuneConfig(output=str(tmp_path), steps=2, seq_len=32, batch_size=2, eval_every=0)
    result = finetune.run(cfg)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "Alice was beginning to get very tired -- déjà vu\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8")) and tokenizer.decode(ids) == text  # the ids the model trained on
    assert tokenizer.eos_token_id == result.model.module.config.eos_token_id
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = tokenizer("Alice", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    expected = prompt["input_ids"]  # greedy decoding with the chunkmem model the run trained
    with torch.no_grad():
        for _ in range(8):
            expected = torch.cat([expected, result.model.eval()(expected).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(generated, expected)
    assert isinstance(tokenizer.decode(generated[0]), str)


def test_output_files_follow_the_umask(tmp_path: Path, tiny_config: str) -> None:
    """Issue 15, item 6: safetensors files were 0600 beside 0644 config.json."""
    old = os.umask(0o027)
    try:
        assert cli.main(["finetune", "--output", str(tmp_path / "out"), "--model", tiny_config, *SMALL,
                         "--steps", "1"]) == 0
    finally:
        os.umask(old)
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: oct(0o640) for p in files}


def test_the_default_streams_chunks_every_step_and_says_so(tmp_path: Path) -> None:
    """Issue 12, item 12, and the device peak against the budget ("Also found")."""
    result = finetune.run(finetune.FinetuneConfig(output=str(tmp_path), steps=6, eval_every=0))
    stats = result.model.memory_stats()
    activations = result.model.runtime.activations.peak
    assert stats["device_limit_bytes"] - activations < stats["model_data_bytes"]  # what chunks get: less
    assert all(moved > 0 for moved in result.traffic.per_step[1:]), result.traffic.per_step
    assert stats["device_bytes_peak"] <= stats["device_limit_bytes"]  # and the default keeps its budget
    assert stats["lean_forwards"] >= 3, "the run's traffic counter (an observer of moves only) keeps forwards lean"
    text = summary(result)
    assert "model data 13.4MiB" in text and "device budget" in text and "per step" in text and "copying" in text
    assert "warning" not in text


def test_a_users_model_keeps_the_free_memory_default(tmp_path: Path, tiny_config: str) -> None:
    result = finetune.run(finetune.FinetuneConfig(model=tiny_config, output=str(tmp_path), steps=4, seq_len=32,
                                                  batch_size=4, eval_every=0))
    stats = result.model.memory_stats()
    assert stats["device_limit_bytes"] >= 2**30 and result.traffic.per_step[1:] == [0, 0, 0]
    assert not result.streaming_default
    assert stats["resident_steps"] >= 2, "steps after the warm-up run resident, the traffic counter on"


def test_a_run_over_its_budget_is_told_so(tmp_path: Path, tiny_config: str, caplog: pytest.LogCaptureFixture) -> None:
    """The summary used to show chunk bytes as the device's (3.4 of 8 MiB while activations took 14.8)."""
    with caplog.at_level("WARNING", logger="chunkmem"):
        result = finetune.run(finetune.FinetuneConfig(model=tiny_config, output=str(tmp_path), steps=2, seq_len=64,
                                                      batch_size=16, eval_every=0, device_memory="1MiB"))
    stats = result.model.memory_stats()
    assert stats["device_bytes_peak"] > stats["device_limit_bytes"] > stats["device_chunk_bytes_peak"]
    assert "exceeded the 1.0MiB budget" in caplog.text and "add --grad-ckpt" in caplog.text
    assert "warning: the device peak" in summary(result)
    module = result.model.module  # checkpointing on: the warning does not ask for it
    getattr(module, "activation_checkpointing_enable", getattr(module, "gradient_checkpointing_enable", None))()
    assert "--grad-ckpt" not in over_budget(result.model)


def test_threads_default_to_one_less_than_the_cpus_and_are_put_back(tmp_path: Path, tiny_config: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15, item 10 (figures: benchmarks/threads.py)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    seen = []
    step = finetune.train_step
    monkeypatch.setattr(finetune, "train_step", lambda *a: seen.append(torch.get_num_threads()) or step(*a))
    before = torch.get_num_threads()
    finetune.run(finetune.FinetuneConfig(model=tiny_config, output=str(tmp_path / "a"), steps=1, seq_len=32,
                                         batch_size=4, eval_every=0))
    finetune.run(finetune.FinetuneConfig(model=tiny_config, output=str(tmp_path / "b"), steps=1, seq_len=32,
                                         batch_size=4, eval_every=0, threads=2))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    finetune.run(finetune.FinetuneConfig(model=tiny_config, output=str(tmp_path / "c"), steps=1, seq_len=32,
                                         batch_size=4, eval_every=0))
    assert seen == [5, 2, before] and torch.get_num_threads() == before


def test_by_default_a_checkpoint_is_written_every_30_minutes_of_training(
        tmp_path: Path, tiny_config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 15, item 2: --save-every defaulted to 0, so a kill at step 190 of 400 lost everything."""
    clock = iter(range(0, 10**6, 11 * 60))  # every reading 11 minutes after the last: a slow step
    monkeypatch.setattr(finetune.time, "perf_counter", lambda: float(next(clock)))
    cfg = finetune.FinetuneConfig(model=tiny_config, output=str(tmp_path), steps=8, seq_len=32, batch_size=4,
                                  eval_every=0, keep=10)
    assert cfg.save_every == 0 and cfg.save_minutes == 30
    finetune.run(cfg)
    saved = RunDir(tmp_path).saved_steps()
    assert saved[-1] == 8 and len(saved) >= 3 and all(b - a <= 3 for a, b in zip([0, *saved], saved))


def test_help_version_and_argument_errors_answer_without_loading_torch(tmp_path: Path) -> None:
    # `chunkmem --help` took 7-27 s on a busy machine because the package imported torch first.
    probe = ("import sys\nfrom chunkmem import cli\ntry:\n    cli.main(sys.argv[1:])\nexcept SystemExit as done:\n"
             "    print('torch' in sys.modules, done.code)")
    for argv in (["--help"], ["--version"], ["finetune", "--help"], ["finetune", "--steps", "many"]):
        done = subprocess.run([sys.executable, "-c", probe, *argv], env=os.environ | {"PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=120)
        assert done.stdout.strip().splitlines()[-1] == f"False {2 if 'many' in argv else 0}", (argv, done.stdout)
    version = subprocess.run([sys.executable, "-m", "chunkmem.cli", "--version"], capture_output=True, text=True,
                             env=os.environ | {"PYTHONPATH": str(ROOT)})
    assert version.stdout.strip() == f"chunkmem {cli.__version__}"
    help_text = subprocess.run([sys.executable, "-m", "chunkmem.cli", "finetune", "--help"], capture_output=True,
                               text=True, env=os.environ | {"PYTHONPATH": str(ROOT)}).stdout
    assert "(default: cosine)" in help_text and "(default: 400)" in help_text and "5e-5" in help_text


def test_a_learning_rate_a_fine_tuning_user_expects() -> None:
    assert finetune.FinetuneConfig().lr == finetune.SCRATCH_LR == 1e-3  # the bundled model starts from random weights
    assert finetune.FinetuneConfig(model="some/config.json").lr == finetune.SCRATCH_LR
    assert finetune.FinetuneConfig(model="a/pretrained/directory").lr == finetune.PRETRAINED_LR == 5e-5
    assert finetune.FinetuneConfig(model="a/pretrained/directory", lr=1e-4).lr == 1e-4


def test_a_resume_keeps_the_schedule_says_when_there_is_nothing_left_and_names_a_damaged_run_file(
        tmp_path: Path, tiny_config: str, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    args = ["finetune", "--output", str(out), "--model", tiny_config, *SMALL, "--save-minutes", "0"]
    assert cli.main([*args, "--steps", "3", "--stop-after", "2"]) == 0
    capsys.readouterr()
    code, err = cli.main([*args, "--steps", "5", "--resume"]), capsys.readouterr().err
    assert code == 2 and "steps was 3, now 5" in err, "another --steps would change the learning-rate schedule"
    assert cli.main([*args, "--steps", "3", "--resume"]) == 0
    capsys.readouterr()
    assert cli.main([*args, "--steps", "3", "--resume"]) == 0
    assert "had finished: all 3 steps are trained" in capsys.readouterr().out
    run_file = out / "run.json"
    run_file.write_text(run_file.read_text()[:10])
    code, err = cli.main([*args, "--steps", "3", "--resume"]), capsys.readouterr().err
    assert code == 2 and f"{run_file} is damaged" in err


@pytest.mark.parametrize("blocks,batch,accum,epochs", [(10, 4, 1, 1.0), (10, 4, 3, 1.0), (13, 2, 2, 1.0),
                                                       (13, 2, 2, 0.5), (9, 3, 1, 2.0), (7, 2, 2, 2.5)])
def test_epochs_count_whole_steps_and_an_epoch_sees_no_block_twice(blocks: int, batch: int, accum: int,
                                                                   epochs: float) -> None:
    # --epochs 1 over 10 blocks in batches of 4 ran ceil(10 / 4) = 3 steps: the third one's blocks came from the next
    # epoch's permutation, so some blocks were seen twice in "one" epoch.
    cfg = finetune.FinetuneConfig(batch_size=batch, grad_accum=accum, epochs=epochs)
    total = finetune.total_steps(cfg, blocks)
    batches = finetune.Batches(torch.arange(blocks), batch, seed=0)
    seen = [batches[step * accum + micro] for step in range(total) for micro in range(accum)]
    per_epoch = blocks // batch  # micro-batches of one permutation
    for epoch in range(math.ceil(len(seen) / per_epoch)):
        rows = torch.cat(seen[epoch * per_epoch:(epoch + 1) * per_epoch])
        assert len(rows.unique()) == len(rows), f"epoch {epoch} saw a block twice"
    assert total == max(1, math.ceil(epochs * max(1, per_epoch // accum)))
    assert len(seen) <= max(accum, math.ceil(epochs) * per_epoch), "no more micro-batches than the epochs hold"
