"""Run inside the llama.cpp tools (a subprocess of the bake, ``sys.path`` set by the caller):

    python -m overbrainer.formats._llama_cpp_run convert LLAMA_CPP PRE -- <convert_hf_to_gguf args>
    python -m overbrainer.formats._llama_cpp_run quantize SRC DEST FTYPE THREADS
    python -m overbrainer.formats._llama_cpp_run template FILE

``convert`` runs llama.cpp's own ``convert_hf_to_gguf.py`` with its vendored gguf-py. llama.cpp
names a BPE pre-tokenizer by hashing how the tokenizer cuts a probe text, and knows only the
hashes of released tokenizers; a tokenizer retrained or extended (the tests' tiny ones) hashes
to nothing it knows. ``PRE`` (from overbrainer.formats.gguf.llama_cpp_pre, which reads the
tokenizer's definition; "" when it cannot tell) is then the name used; a known hash always wins.

``quantize`` calls llama.cpp's ``llama_model_quantize`` (llama-cpp-python's binding) on a
16-bit GGUF. ``template`` asks llama.cpp's own chat (``llama_chat_apply_template``, what
llama-cli and llama-server use without ``--jinja``) whether it knows the Jinja template in FILE:
it prints what the template makes of a probe conversation and exits 0, or exits 3 when llama.cpp
does not recognise it. Stdlib and the tools only: nothing of overbrainer is imported here.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def convert(llama_cpp: str, pre: str, args: list[str]) -> None:
    root = Path(llama_cpp)
    sys.path[0:0] = [str(root), str(root / "gguf-py")]
    from conversion import base

    recognised = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            if pre:
                return pre
            raise

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [str(root / "convert_hf_to_gguf.py"), *args]
    runpy.run_path(str(root / "convert_hf_to_gguf.py"), run_name="__main__")


def quantize(src: str, dest: str, ftype: str, threads: str) -> None:
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.nthread = int(threads)
    rc = llama_cpp.llama_model_quantize(src.encode(), dest.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize returned {rc}")


def template(path: str) -> None:
    import ctypes

    import llama_cpp

    roles = [(b"system", b"S"), (b"user", b"U1"), (b"assistant", b"A1"), (b"user", b"U2")]
    chat = (llama_cpp.llama_chat_message * len(roles))(*(llama_cpp.llama_chat_message(r, c) for r, c in roles))
    size = 1 << 16
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(Path(path).read_bytes(), chat, len(roles), True, buf, size)
    if n < 0:
        sys.exit(3)
    print(buf.raw[:n].decode("utf-8", "replace"))


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "convert":
        convert(rest[0], rest[1], rest[3:])  # rest[2] is "--"
    elif command == "quantize":
        quantize(*rest)
    elif command == "template":
        template(*rest)
    else:
        sys.exit(f"unknown command {command!r}")
