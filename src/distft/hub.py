"""Whether the Hugging Face hub can be reached (a leaf: the model, the tokenizer and the planner ask)."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse


def hub_offline() -> bool:
    """True when the Hugging Face hub cannot be used: HF_HUB_OFFLINE is set, or its host does not
    accept a connection within 3 s.

    Without the probe an unreachable hub costs huggingface_hub's five retries (~30 s) per file
    before failing; with it, hub ids load from the local cache at once (`local_files_only`), and
    an uncached one fails in seconds. Behind a proxy the probe cannot tell, so it is skipped.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return True
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError:
        return True
    return False
