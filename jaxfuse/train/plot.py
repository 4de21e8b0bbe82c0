"""The loss curve of a run: training and validation loss in bits per byte against the step."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxfuse.train.corpus import LN2


def plot_losses(history: dict, entropy: float, path: Path) -> None:
  """Training and validation loss in bits/byte against the step, with the unigram entropy."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(history["step"], np.asarray(history["loss"]) / LN2, label="train", lw=1)
  if history["val_loss"]:
    ax.plot(history["val_step"], np.asarray(history["val_loss"]) / LN2, "o-", label="validation")
  ax.axhline(entropy, color="gray", ls="--", label=f"unigram entropy ({entropy:.2f})")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (bits/byte)")
  ax.legend()
  ax.set_title("jaxfuse.train: byte-level decoder on the Python standard library")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
