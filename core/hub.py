"""Check once, before loading, that a hub id can be served: from a local folder, the local cache,
or one request to the hub.

Without this, ``from_pretrained`` on a machine without hub access retries five times over ~25 s
and ends in three chained tracebacks; a gated model fails the same way deep inside a download.
Here the first failure becomes one :class:`~draftsmith.errors.HubError` that names the id, the
case (offline, unreachable, gated, missing) and how to point the recipe at a local folder.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from draftsmith.errors import HubError

RepoType = Literal["model", "dataset"]
# What a complete repo of each type always holds, to look up in the cache and on the hub.
_PROBE_FILE = {"model": "config.json", "dataset": None}


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` (or the older ``TRANSFORMERS_OFFLINE``) asks for no network."""
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _cached(repo_id: str, repo_type: RepoType) -> bool:
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    probe = _PROBE_FILE[repo_type]
    if probe is not None:
        return isinstance(try_to_load_from_cache(repo_id, probe, repo_type=repo_type), str)
    try:
        return any(r.repo_id == repo_id and r.repo_type == repo_type for r in scan_cache_dir().repos)
    except Exception:  # no cache folder yet
        return False


def _local_hint(repo_id: str, field: str, repo_type: RepoType) -> str:
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    return (
        f"download it where the hub is reachable (`hf download {repo_id}{kind} --local-dir DIR`) "
        f"and set {field} to that folder"
    )


def check_hub_id(repo_id: str, field: str, repo_type: RepoType = "model") -> None:
    """Raise :class:`HubError` unless ``repo_id`` (given as ``field``) can be loaded.

    A local path is left to the loader. A hub id passes when it is in the local cache; else,
    unless ``HF_HUB_OFFLINE`` is set, one request (no retries) tells reachable from unreachable,
    gated from missing. When the hub is unreachable but the cache holds the repo, offline mode
    is switched on for this process so the loaders do not retry the network.
    """
    if Path(repo_id).exists() or repo_id.startswith((".", "/", "~")) or repo_id.count("/") > 1:
        if not Path(repo_id).expanduser().exists():
            raise HubError(f"{field}: {repo_id} does not exist; give an existing folder, a .gguf file or a hub id")
        return
    if hub_offline():
        if _cached(repo_id, repo_type):
            return
        raise HubError(
            f"{field}: {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            + _local_hint(repo_id, field, repo_type)
        )
    from huggingface_hub import HfApi, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        probe = _PROBE_FILE[repo_type]
        if probe is not None:
            get_hf_file_metadata(hf_hub_url(repo_id, probe, repo_type=repo_type), timeout=10)
        else:
            HfApi().repo_info(repo_id, repo_type=repo_type, timeout=10)
    except GatedRepoError:
        raise HubError(
            f"{field}: {repo_id!r} is a gated {repo_type} on the Hugging Face hub: accept its licence on "
            f"its hub page and log in (`hf auth login` or HF_TOKEN), or " + _local_hint(repo_id, field, repo_type)
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{field}: no {repo_type} {repo_id!r} on the Hugging Face hub (or it is private and you are "
            "not logged in); check the id, or give a local folder"
        ) from None
    except HfHubHTTPError as err:
        raise HubError(
            f"{field}: the Hugging Face hub refused {repo_id!r} ({err}); " + _local_hint(repo_id, field, repo_type)
        ) from None
    except Exception as err:  # no network: DNS, connection, timeout, proxy errors of whichever HTTP client
        if _cached(repo_id, repo_type):
            import huggingface_hub.constants

            os.environ["HF_HUB_OFFLINE"] = "1"  # child processes
            huggingface_hub.constants.HF_HUB_OFFLINE = True  # read by the loaders of this process
            print(f"the Hugging Face hub is unreachable ({type(err).__name__}); using the cached copy of {repo_id}")
            return
        raise HubError(
            f"{field}: cannot reach the Hugging Face hub to fetch {repo_id!r} ({type(err).__name__}: "
            f"{err}) and it is not in the local cache; "
            + _local_hint(repo_id, field, repo_type)
            + " (gated repos, such as Llama models, also need their licence accepted on the hub and "
            "`hf auth login` first)"
        ) from None
