"""The ``rl`` suite's plumbing at a few steps (the learning itself is the benchmark's: a test
does not time or train to convergence): its records, their series and notes, the plot."""

import json

import pytest

from benchmarks import harness
from benchmarks.suites import rl

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  patch = pytest.MonkeyPatch()
  patch.setattr(rl, "SFT_STEPS", 10)
  patch.setattr(rl, "QUICK_GRPO_STEPS", 3)
  patch.setattr(rl, "ROLLOUT_TOKENS", 4)
  try:
    yield rl.run(harness.Context(suite="rl", quick=True, runs=1))
  finally:
    patch.undo()


def test_the_grpo_rows_carry_their_rewards(records):
  grpo = [r for r in records if r.case.startswith("grpo")]
  assert [r.impl for r in grpo] == ["jaxfuse", "jax-unfused"]
  for r in grpo:
    rewards = r.series["reward"]
    assert len(rewards) == 3 and all(0.0 <= x <= 1.0 for x in rewards)
    assert f"mean reward {rewards[0]:.3f} at step 1" in r.note
    assert r.time_ms["median"] > 0
  # Both runs start from the same checkpoint and sample with the same keys: step 1 is equal.
  assert grpo[0].series["reward"][0] == grpo[1].series["reward"][0]


def test_the_rollout_rows_and_the_plot(records, tmp_path):
  speed = [r for r in records if r.case.startswith("rollout")]
  assert [r.impl for r in speed] == ["jaxfuse", "hf-generate"]
  assert all(r.note.endswith("new tokens/s") for r in speed)
  assert speed[1].ratio == 1.0
  path = tmp_path / "rl.png"
  rl.plot(records, str(path))
  assert path.stat().st_size > 10_000
  json.dumps([r.note for r in records])
