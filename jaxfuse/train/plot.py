"""The loss curve of a run: training and evaluation loss against the step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxfuse.train.corpus import LN2


def plot_losses(history: dict, entropy: float | None, path: Path, *, unit: float = LN2,
                per: str = "bits/byte") -> None:
  """Training and evaluation loss (nats divided by ``unit``: bits per byte for the byte corpus,
  nats per token otherwise) against the step, with the byte corpus' unigram ``entropy`` where
  given."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(history["step"], np.asarray(history["loss"]) / unit, label="train", lw=1)
  if history["val_loss"]:
    ax.plot(history["val_step"], np.asarray(history["val_loss"]) / unit, "o-",
            label="evaluation")
  if entropy is not None:
    ax.axhline(entropy, color="gray", ls="--", label=f"unigram entropy ({entropy:.2f})")
  ax.set_xlabel("step")
  ax.set_ylabel(f"loss ({per})")
  ax.legend()
  ax.set_title("jaxfuse.train: " + ("byte-level decoder on the Python standard library"
                                    if entropy is not None else "loss per step"))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
