"""Model folders by local path or Hugging Face Hub id, resolved from the local cache only (never the network).
Light on purpose (no torch): the data tools and the trainer's start-up checks read it."""
import os
import re
from pathlib import Path

from huggingface_hub import snapshot_download

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")   # org/name, as the Hugging Face Hub spells a model id


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time (huggingface_hub reads it once, at import):
    HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub (XDG_CACHE_HOME respected)."""
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ.get("HF_HUB_CACHE") or os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("HF_HOME") or xdg / "huggingface").expanduser() / "hub"


def resolve_model_path(name_or_path) -> Path:
    """A model folder from a local path or a Hub id. An existing folder is returned as it is; an id like
    `Qwen/Qwen3-8B` is looked up in the local Hugging Face cache (models--Qwen--Qwen3-8B/snapshots/<refs/main>/),
    never over the network. FileNotFoundError naming the folder looked in, and how to fill it, otherwise."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"model {name_or_path}: {path} is a file; pass a model folder or a Hub id")
        return path
    name = str(name_or_path)
    if not HUB_ID.fullmatch(name):
        raise FileNotFoundError(f"model {name!r}: no such folder, and not a Hub id (org/name)")
    cache = hub_cache_dir()
    fix = (f"download it on a machine with network (`hf download {name}`, or `huggingface-cli download {name}` "
           f"with an older huggingface_hub) into that cache (HF_HUB_CACHE / HF_HOME select it), or pass a local folder")
    try:
        snap = Path(snapshot_download(name, cache_dir=cache, local_files_only=True))
    except FileNotFoundError as e:    # huggingface_hub's LocalEntryNotFoundError is one
        raise FileNotFoundError(f"model {name}: not in the Hugging Face cache {cache} ({type(e).__name__}); "
                                f"{fix}") from None
    if not (snap / "config.json").exists():
        raise FileNotFoundError(f"model {name}: the cached snapshot {snap} has no config.json (an incomplete "
                                f"download?); {fix}")
    return snap
