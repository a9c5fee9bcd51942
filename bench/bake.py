"""Baking GGUF files of SmolLM2-135M-Instruct: today's pure-Python writer (formats/gguf.py)
against the llama.cpp route (llama.cpp's convert_hf_to_gguf.py and llama_model_quantize,
formats/llama_cpp.py), side by side in one run, each bake in a process of its own::

    .venv/bin/python bench/bake.py [--model smollm2|tiny] [--repeat 1]

f16: both sides. q4_k_m: llama.cpp's alone (the Python writer has no K-quants); its nearest,
q4_0, is timed on both sides instead. llama.cpp's tools are built first if they are not
(``$OVERBRAINER_LLAMA_CPP`` or the cache; the build is not timed here, its marker says how
long it took). Wall and CPU seconds per file, the file sizes, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import measure, print_machine, save_json, table, work_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PYTHON_SIDE = """
import sys
from pathlib import Path
from overbrainer.formats.gguf import write_gguf
write_gguf(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], "bench")
"""
LLAMA_SIDE = """
import sys
from pathlib import Path
from overbrainer.formats.llama_cpp import llama_cpp_tools, write_ggufs
llama_cpp_tools(say=lambda m: None)
out = Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
import overbrainer.formats as f
f.python_writer_covers = lambda config, qtype: False  # the llama.cpp route for every type
write_ggufs(Path(sys.argv[1]), out, "bench", [sys.argv[3]], say=lambda m: None)
"""


def model(name: str) -> Path:
    if name == "tiny":
        sys.path.insert(0, str(REPO / "tests"))
        from tiny import make_tiny_llama

        return make_tiny_llama(work_dir("bake") / "tiny-llama")
    from overbrainer.inputs.base_cache import materialize
    from overbrainer.inputs.base_model import parse_base

    return materialize(parse_base("smollm2-135m-instruct", Path(".")), log=lambda m: print(m, flush=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    header = print_machine()
    merged = model(args.model)
    from overbrainer.formats.llama_cpp import llama_cpp_tools

    tools = llama_cpp_tools()
    built = json.loads((tools / "overbrainer-tools.json").read_text())
    print(f"llama.cpp tools at {tools}, built in {built['seconds']:.0f} s")
    out = work_dir("bake") / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rows = []
    for qtype in ("f16", "q4_0", "q4_k_m"):
        for side, code in (("python writer", PYTHON_SIDE), ("llama.cpp", LLAMA_SIDE)):
            if side == "python writer" and qtype == "q4_k_m":
                rows.append({"type": qtype, "side": side, "wall s": "—", "cpu s": "—", "MB": "no K-quants"})
                continue
            best = None
            for _ in range(args.repeat):
                dest = out / side.replace(" ", "-") / qtype
                target = dest if side == "llama.cpp" else dest.with_suffix(".gguf")
                target.parent.mkdir(parents=True, exist_ok=True)
                m = measure([sys.executable, "-c", code, str(merged), str(target), qtype], env=env).check()
                best = m if best is None or m.wall < best.wall else best
            files = list(target.glob("*.gguf")) if target.is_dir() else [target]
            rows.append({"type": qtype, "side": side, "wall s": round(best.wall, 2), "cpu s": round(best.user + best.system, 2),
                         "MB": round(sum(f.stat().st_size for f in files) / 1e6, 1)})
    for qtype in ("f16", "q4_0"):
        py, cpp = (r for r in rows if r["type"] == qtype)
        cpp["ratio (llama.cpp / python)"] = f"{cpp['wall s'] / py['wall s']:.2f}×"
    print(table(rows, ["type", "side", "wall s", "cpu s", "MB", "ratio (llama.cpp / python)"]))
    save_json("bake", {"machine": header, "model": args.model, "rows": rows, "llama_cpp_build_s": built["seconds"]})


if __name__ == "__main__":
    main()
