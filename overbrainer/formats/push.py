"""Upload a run's ``baked/`` to the Hugging Face Hub: ``overbrainer push RUN org/name``.

``huggingface_hub``'s `create_repo` (``exist_ok``: a second push updates the same repository)
then `upload_folder`, one commit with every file of ``baked/`` (GGUFs included; large files go
through the Hub's LFS/Xet storage as huggingface_hub does it). The token is huggingface_hub's
own: ``$HF_TOKEN`` or ``hf auth login``'s. What fails is said in one line with the fix, and
the token is never printed.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import OverbrainerError

__all__ = ["PushError", "push"]


class PushError(OverbrainerError):
    """The Hub could not be reached, refused the token, or refused the repository."""

    kind = "push"


def push(baked: Path, repo: str, private: bool = False, revision: str | None = None, say=print) -> str:
    """Upload ``baked`` to the model repository ``repo``; the commit's URL."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if not (baked / "README.md").is_file():
        raise PushError(f"push: {baked} is not a finished bake (no README.md); bake the run first")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise PushError("push: HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset HF_HUB_OFFLINE and push again")
    token = get_token()
    if not token:
        raise PushError("push: no Hugging Face token; set HF_TOKEN or run `hf auth login`, then push again")
    api = HfApi(token=token)
    try:
        say(f"push: creating or reusing https://huggingface.co/{repo}")
        api.create_repo(repo, repo_type="model", private=private, exist_ok=True)
        if revision:
            api.create_branch(repo, branch=revision, exist_ok=True)
        say(f"push: uploading {baked} ({_size(baked)})")
        info = api.upload_folder(repo_id=repo, folder_path=baked, repo_type="model", revision=revision,
                                 commit_message="Upload a bake made by overbrainer")
    except OfflineModeIsEnabled:
        raise PushError("push: HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it and push again") from None
    except HfHubHTTPError as e:
        raise PushError(_refused(repo, e, token)) from None
    except (OSError, *_transport_errors()) as e:  # the connection itself: refused, timed out, no DNS
        raise PushError(f"push: could not reach the Hub ({_hide(type(e).__name__ + ': ' + str(e), token)[:200]}); "
                        "check the network or HF_ENDPOINT, then push again") from None
    url = getattr(info, "commit_url", None) or f"https://huggingface.co/{repo}"
    say(f"push: done, {url}")
    return url


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The HTTP client's errors of the connection itself (huggingface_hub 2 uses httpx2; older
    ones httpx or requests)."""
    import importlib

    found = []
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError")):
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def _refused(repo: str, e, token: str) -> str:
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status == 401:
        return "push: the Hub refused the token (401); set HF_TOKEN to a valid token with write access, then push again"
    if status == 403:
        return f"push: the token may not write to {repo} (403); use a token with write access to that namespace"
    if status in (400, 422):
        return f"push: the Hub refused the name {repo!r} ({status}); use org/name with letters, digits, '-', '_', '.'"
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return f"push: the Hub answered {status or 'an error'}: {_hide(first, token)}; fix that and push again"


def _hide(text: str, token: str) -> str:
    return text.replace(token, "***") if token else text


def _size(folder: Path) -> str:
    n = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return f"{n / 1e6:.1f} MB"
