"""``overbrainer push``: baked/ to the Hub with huggingface_hub. No test reaches the Hub: the
upload itself (HfApi's create_repo, create_branch, upload_folder: the network boundary) is
replaced where a test needs it to answer, and said so there; the offline, no-token and
unreachable cases run huggingface_hub for real."""

from __future__ import annotations

import pytest
from helpers import cli

from overbrainer.formats.push import PushError, push

TOKEN = "hf_secretSECRETsecret0123456789"


@pytest.fixture
def baked(tmp_path):
    folder = tmp_path / "baked"
    folder.mkdir()
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# demo\n")
    (folder / "demo-q4_k_m.gguf").write_bytes(b"GGUF" + bytes(60))
    return folder


def one_line(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_push_offline_is_one_line_with_the_fix(baked_copy):
    project = baked_copy()
    line = one_line(cli("push", "tiny", "someone/tiny", "--runs", str(project.root.parent / "runs"), check=2))
    assert line == "error: push: HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset HF_HUB_OFFLINE and push again"


def test_push_without_a_token(baked, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(PushError, match="no Hugging Face token; set HF_TOKEN or run `hf auth login`"):
        push(baked, "someone/demo", say=lambda _: None)


def test_an_unreachable_hub_is_one_line_and_hides_the_token(baked, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: a real refusal
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(PushError) as e:
        push(baked, "someone/demo", say=lambda _: None)
    assert "could not reach the Hub" in str(e.value) and TOKEN not in str(e.value)


def test_push_creates_the_repo_and_uploads_baked(baked, monkeypatch):
    # the network boundary, replaced: what HfApi would send to the Hub is recorded
    from huggingface_hub import HfApi

    calls = []
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo, **kw: calls.append(("create_repo", repo, kw, self.token)))
    monkeypatch.setattr(HfApi, "create_branch", lambda self, repo, **kw: calls.append(("create_branch", repo, kw)))

    def upload_folder(self, **kw):
        calls.append(("upload_folder", kw))
        return type("Commit", (), {"commit_url": "https://huggingface.co/someone/demo/commit/abc"})()

    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    said = []
    url = push(baked, "someone/demo", private=True, revision="v1", say=said.append)
    assert url == "https://huggingface.co/someone/demo/commit/abc"
    assert calls[0] == ("create_repo", "someone/demo", {"repo_type": "model", "private": True, "exist_ok": True}, TOKEN)
    assert calls[1] == ("create_branch", "someone/demo", {"branch": "v1", "exist_ok": True})
    assert calls[2][1]["folder_path"] == baked and calls[2][1]["revision"] == "v1"
    assert not any(TOKEN in line for line in said)


@pytest.mark.parametrize("status, says", [(401, "refused the token"), (403, "may not write to someone/demo"),
                                          (400, "refused the name 'someone/demo'")])
def test_hub_refusals_are_one_line_without_the_token(baked, monkeypatch, status, says):
    import httpx2 as httpx
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    def refuse(self, repo, **kw):  # the Hub's answer, replaced (the network boundary)
        response = httpx.Response(status, request=httpx.Request("POST", "https://huggingface.co/api/repos/create"))
        raise HfHubHTTPError(f"{status} Client Error for token {TOKEN}", response=response)

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(HfApi, "create_repo", refuse)
    with pytest.raises(PushError) as e:
        push(baked, "someone/demo", say=lambda _: None)
    assert says in str(e.value) and TOKEN not in str(e.value)


def test_push_needs_a_finished_bake(tmp_path):
    with pytest.raises(PushError, match="not a finished bake"):
        push(tmp_path, "someone/demo", say=lambda _: None)
