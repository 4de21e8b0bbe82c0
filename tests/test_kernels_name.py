"""The repository's `kernels/` directory (installed as `jaxfuse.kernels`) does not shadow an
installed top-level `kernels` package (Hugging Face's, which transformers imports) when the
repository's root is on `sys.path`, as it is under `python -m pytest` from the root."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(code: str, extra_path: str | None, *options: str) -> str:
  path = [str(ROOT)] + ([extra_path] if extra_path else [])
  env_code = f"import sys; sys.path[:0] = {path!r}\n" + code
  return subprocess.run([sys.executable, *options, "-c", env_code], cwd=ROOT,
                        capture_output=True, text=True, check=True).stdout.strip()


def test_an_installed_kernels_package_wins(tmp_path):
  (tmp_path / "kernels").mkdir()
  (tmp_path / "kernels" / "__init__.py").write_text("CUDAProperties = 'installed'\n")
  (tmp_path / "kernels" / "layer.py").write_text("LAYER = 1\n")
  out = _run("from kernels import CUDAProperties\nimport kernels.layer\n"
             "import jaxfuse.kernels.pallas.common\nprint(CUDAProperties, kernels.layer.LAYER)",
             str(tmp_path))
  assert out == "installed 1"


def test_without_one_the_directory_stays_an_empty_module():
  """No site-packages (``-S``): nothing else is named ``kernels``."""
  out = _run("import kernels\nprint(kernels.__file__, hasattr(kernels, 'CUDAProperties'))",
             None, "-S")
  assert out == f"{ROOT / 'kernels' / '__init__.py'} False"
