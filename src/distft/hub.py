"""Whether the Hugging Face hub can be reached, and whether a name is for it at all (a leaf: the model,
the tokenizer and the planner ask)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from urllib.parse import urlparse


def hub_offline() -> bool:
    """True when the Hugging Face hub cannot be used: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is
    set, or its host does not accept a connection within 3 s.

    Without the probe an unreachable hub costs huggingface_hub's five retries (~30 s) per file
    before failing; with it, hub ids load from the local cache at once (`local_files_only`), and
    an uncached one fails in seconds. Behind a proxy the probe cannot tell, so it is skipped.
    """
    if any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError:
        return True
    return False


def not_a_directory(name: str) -> str | None:
    """What is wrong with a model name that is a path (absolute, relative with ./ or ../, ~, or
    deeper than ORG/NAME), never a hub id, when it names no directory; None when it does, or when
    `name` may be a hub id. The model's loader and the tokenizer's both refuse it, with this."""
    path = Path(name).expanduser()
    looks_like_path = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or path.exists()
    if not looks_like_path or path.is_dir():
        return None
    if path.exists():
        return f"--model {name} is a file; give the directory that holds its config.json and *.safetensors."
    made_by = (  # a full-finetuning run's output, named before that run was made (a staged config)
        f" It is where a full-finetuning run writes its model (`distft train --method full --out "
        f"{path.parent}`): train that run first."
        if path.name == "model"
        else ""
    )
    return (
        f"Model directory {name} does not exist (a path, not a hub id: those read ORG/NAME).{made_by} If a "
        "run recorded it (model.name in its config.toml; base_model_name_or_path in its adapter's "
        "adapter_config.json), the directory has since moved or been deleted: put it back, or set the "
        "record to where it is now."
    )
