"""Every Python block of the README and of docs/ops.md runs as written (in order, one namespace
per file, as a reader would paste them), and every `python -m jaxfuse.train` command line in
them parses."""

import re
import shlex
from pathlib import Path

import pytest

from jaxfuse import train

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "docs/ops.md"]


def _blocks(path: Path, language: str) -> list[str]:
  return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("doc", DOCS)
def test_python_blocks_run_as_written(doc, tmp_path, monkeypatch, capsys):
  blocks = _blocks(ROOT / doc, "python")
  assert blocks, f"{doc} has no python blocks"
  monkeypatch.chdir(tmp_path)
  namespace = {"__name__": "__readme__"}
  for i, block in enumerate(blocks):
    try:
      exec(compile(block, f"{doc} block {i + 1}", "exec"), namespace)  # noqa: S102
    except Exception as e:  # noqa: BLE001 - name the block that failed
      raise AssertionError(f"{doc}, python block {i + 1} failed: {type(e).__name__}: {e}") from e


def test_training_command_lines_parse():
  commands = [line.split("#")[0].strip() for doc in DOCS
              for block in _blocks(ROOT / doc, "bash") for line in block.splitlines()
              if line.strip().startswith("python -m jaxfuse.train")]
  assert commands
  for command in commands:
    argv = shlex.split(command)[3:]
    cfg = train.parse_args(argv)
    train._check(cfg)


def test_configuration_files_read_as_written(tmp_path):
  """Each YAML block of the README is a configuration file ``--config`` reads, and its first
  line's command line runs it with the file's options."""
  blocks = _blocks(ROOT / "README.md", "yaml")
  assert blocks
  for i, block in enumerate(blocks):
    path = tmp_path / f"block{i}.yaml"
    path.write_text(block)
    values = train.read_config_file(path)
    assert values
    cfg = train.parse_args(["--config", str(path)])
    assert all(getattr(cfg, k) == v for k, v in values.items())
    train._check(cfg)


FINE_TUNE_MARKER = "<!-- fine-tune example"


def test_fine_tuning_commands_run_as_written(tmp_path, monkeypatch, capsys):
  """The README's three fine-tuning commands, as written, on a tiny checkpoint `transformers`
  wrote (``my-llama``, with its tokenizer and chat template) and chats the test writes: the run
  learns, the export loads in transformers with the run's logits, generation prints text."""
  import numpy as np
  import torch
  import transformers

  from jaxfuse import export, generate
  from jaxfuse.testing.checkpoints import arithmetic_chats, write_jsonl, write_tiny_checkpoint

  readme = (ROOT / "README.md").read_text()
  block = re.search(rf"{re.escape(FINE_TUNE_MARKER)}.*?\n```bash\n(.*?)```", readme, re.S)
  assert block, "the README has no fine-tuning example"
  commands = [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]
  assert [c[:3] for c in commands] == [["python", "-m", "jaxfuse.train"],
                                       ["python", "-m", "jaxfuse.export"],
                                       ["python", "-m", "jaxfuse.generate"]]
  monkeypatch.chdir(tmp_path)
  write_tiny_checkpoint(tmp_path / "my-llama")
  write_jsonl(tmp_path / "chats.jsonl", arithmetic_chats(64))
  mains = {"jaxfuse.train": train.main, "jaxfuse.export": export.main,
           "jaxfuse.generate": generate.main}
  for command in commands:
    assert mains[command[2]](command[3:]) == 0, shlex.join(command)
  printed = capsys.readouterr().out
  run = tmp_path / train.parse_args(commands[0][3:]).out
  history = __import__("json").loads((run / "train_log.json").read_text())["history"]
  assert history["loss"][-1] < history["loss"][0]   # it learns
  assert printed.strip()   # the generated answer
  # The exported checkpoint is the run's model, adapters folded in.
  model, tokenizer = generate.load(run)
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / commands[1][4])
  ids = tokenizer.apply_chat_template(arithmetic_chats(1)[0]["messages"], tokenize=True)
  ids = ids["input_ids"] if hasattr(ids, "keys") else ids
  with torch.no_grad():
    want = hf(torch.tensor([ids])).logits.numpy()
  got = np.asarray(model.logits(np.asarray([ids])))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "my-llama")
  with torch.no_grad():
    assert not np.allclose(base(torch.tensor([ids])).logits.numpy(), want, atol=1e-3)


PREFERENCE_MARKER = "<!-- preference example"


def test_preference_commands_run_as_written(tmp_path, monkeypatch, capsys):
  """The README's three DPO commands, as written, on a tiny checkpoint `transformers` wrote and
  preference pairs the test writes: the run raises the chosen answers' reward margin, the
  export loads in transformers, generation prints text."""
  import json

  import transformers

  from jaxfuse import export, generate
  from jaxfuse.testing.checkpoints import write_tiny_checkpoint

  readme = (ROOT / "README.md").read_text()
  block = re.search(rf"{re.escape(PREFERENCE_MARKER)}.*?\n```bash\n(.*?)```", readme, re.S)
  assert block, "the README has no preference example"
  commands = [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]
  assert [c[:3] for c in commands] == [["python", "-m", "jaxfuse.train"],
                                       ["python", "-m", "jaxfuse.export"],
                                       ["python", "-m", "jaxfuse.generate"]]
  monkeypatch.chdir(tmp_path)
  write_tiny_checkpoint(tmp_path / "my-llama")
  pairs = [{"prompt": f"What is {i % 10} plus {i % 7}?", "chosen": f" {i % 10 + i % 7}.",
            "rejected": f" {i % 10 + i % 7 + 1}, or so."} for i in range(48)]
  (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
  mains = {"jaxfuse.train": train.main, "jaxfuse.export": export.main,
           "jaxfuse.generate": generate.main}
  for command in commands:
    assert mains[command[2]](command[3:]) == 0, shlex.join(command)
  assert capsys.readouterr().out.strip()   # the generated answer
  run = tmp_path / train.parse_args(commands[0][3:]).out
  history = json.loads((run / "train_log.json").read_text())["history"]
  margins = history["metrics"]["rewards/margins"]
  assert sum(margins[-5:]) / 5 > sum(margins[:5]) / 5 + 0.05, margins   # it learns
  assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / commands[1][4])


GRPO_MARKER = "<!-- grpo example"


def test_grpo_command_runs_as_written(tmp_path, monkeypatch):
  """The README's reward function and GRPO command, as written, on a tiny checkpoint
  `transformers` wrote and prompt records the test writes: the run ends and reports the rewards
  of both functions."""
  import json

  from jaxfuse.testing.checkpoints import write_tiny_checkpoint

  readme = (ROOT / "README.md").read_text()
  reward = re.search(r"```python\n# my_rewards.py\n(.*?)```", readme, re.S)
  block = re.search(rf"{re.escape(GRPO_MARKER)}.*?\n```bash\n(.*?)```", readme, re.S)
  assert reward and block, "the README has no GRPO example"
  commands = [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]
  assert [c[:3] for c in commands] == [["python", "-m", "jaxfuse.train"]]
  monkeypatch.chdir(tmp_path)
  write_tiny_checkpoint(tmp_path / "my-llama")
  (tmp_path / "my_rewards.py").write_text(reward.group(1))
  rows = [{"prompt": f"What is {a} plus {b}?", "answer": a + b} for a in range(6) for b in range(4)]
  (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert train.main(commands[0][3:]) == 0
  run = tmp_path / train.parse_args(commands[0][3:]).out
  metrics = json.loads((run / "train_log.json").read_text())["history"]["metrics"]
  steps = train.parse_args(commands[0][3:]).steps
  assert len(metrics["rewards/answer_first"]) == len(metrics["rewards/exact_match"]) == steps
