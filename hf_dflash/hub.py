"""Published DFlash drafters: their configs, kept in hub_configs/ with the target each belongs to and its source.

`import hf_dflash` registers them with `DFlashConfig.published_configs`, so `DFlashConfig.from_pretrained(repo_id)`
answers for them where the Hub is out of reach and nothing is cached (config only: weights still come from the Hub).
`use_offline_hub_when_unreachable` lets the command line find out at once that the Hub is out of reach, instead of
after huggingface_hub's retries (about half a minute per file).
"""

from __future__ import annotations

import json
import socket
import urllib.request
from urllib.parse import urlparse
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from .modeling import DFlashConfig

# Installed, hub_configs/ is package data inside hf_dflash/ (pyproject.toml maps it there); in a checkout (an editable
# install) it is the repository's top-level folder beside hf_dflash/.
_PACKAGE_DIR = Path(__file__).resolve().parent
_INSTALLED_CONFIGS = _PACKAGE_DIR / "hub_configs"
HUB_CONFIGS = _INSTALLED_CONFIGS if _INSTALLED_CONFIGS.is_dir() else _PACKAGE_DIR.parent / "hub_configs"


@dataclass(frozen=True)
class PublishedDrafter:
    """One entry of hub_configs/index.json: a drafter on the Hub, its target, and where its config was read."""

    repo_id: str
    target: str
    config: dict[str, Any]
    source: str
    unverified: list[str] = field(default_factory=list)
    published_weights_gib: float | None = None  # size of its safetensors file as listed on the Hub (bfloat16)
    published_parameters: int | None = None


@cache
def published_drafters() -> dict[str, PublishedDrafter]:
    """Every drafter of hub_configs/, by Hub id."""
    index = json.loads((HUB_CONFIGS / "index.json").read_text())
    return {
        entry["repo_id"]: PublishedDrafter(
            repo_id=entry["repo_id"],
            target=entry["target"],
            config=json.loads((HUB_CONFIGS / entry["file"]).read_text()),
            source=entry["source"],
            unverified=entry.get("unverified", []),
            published_weights_gib=entry.get("published_weights_gib"),
            published_parameters=entry.get("published_parameters"),
        )
        for entry in index
    }


def register_published_configs() -> None:
    """Let `DFlashConfig.from_pretrained` fall back on hub_configs/ (a no-op where the folder is not shipped)."""
    if not (HUB_CONFIGS / "index.json").is_file():
        return
    for repo_id, drafter in published_drafters().items():
        DFlashConfig.published_configs[repo_id] = {**drafter.config, "target_model": drafter.target}


# How long a connection to the Hub (or the proxy in front of it) may take before the Hub counts as out of reach.
HUB_CONNECT_TIMEOUT_S = 3.0


@cache
def use_offline_hub_when_unreachable() -> str | None:
    """Why the Hub is offline for this process (HF_HUB_OFFLINE, or no TCP connection within HUB_CONNECT_TIMEOUT_S),
    or None when it can be reached. An unreachable Hub switches huggingface_hub to offline mode, so every later
    look-up answers from the local cache (or hub_configs/) at once instead of retrying."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(constants.ENDPOINT)
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    if proxy and "://" not in proxy:
        proxy = "http://" + proxy  # `host:port`, as requests (which huggingface_hub uses) reads it
    reach = urlparse(proxy) if proxy and not urllib.request.proxy_bypass(endpoint.hostname or "") else endpoint
    port = reach.port or (443 if reach.scheme == "https" else 80)
    try:
        socket.create_connection((reach.hostname, port), timeout=HUB_CONNECT_TIMEOUT_S).close()
    except OSError as error:
        constants.HF_HUB_OFFLINE = True  # read by huggingface_hub.is_offline_mode, which transformers asks too
        return f"{reach.hostname}:{port} cannot be reached: {error.strerror or error}"
    return None


__all__ = [
    "HUB_CONFIGS",
    "PublishedDrafter",
    "published_drafters",
    "register_published_configs",
    "use_offline_hub_when_unreachable",
]
