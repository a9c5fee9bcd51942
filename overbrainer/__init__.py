"""overbrainer: fine-tuning a language model, declared as a build.

The Python API (what a notebook touches)::

    import overbrainer
    run = overbrainer.bake("plans/demo.json")      # returns at once: the run has its own process
    run.progress()                                 # state, step of steps, loss, eval_loss, eta
    run.metrics()                                  # the loss curve so far, as a pyarrow Table
    run.stop(); run.resume()                       # from the last checkpoint, exactly
    model = run.wait()                             # the baked model, when it is done
    model.chat("Hello!")
    run.checkpoint(18).chat("Hello!")              # any checkpoint as a model

Heavy libraries (torch, transformers) load only when a model is loaded or trained.
"""

from __future__ import annotations

from .version import __version__

__all__ = ["bake", "run", "runs", "Run", "Model", "__version__"]


def bake(plan, wait: bool = False, runs=None, show: bool = True, force: bool = False):
    """Bake a plan in its own process and return its `Run` at once (``wait=True``: wait
    for the end, showing progress, and return the baked model). Baking the same plan again
    finds its folder: it follows a running bake, resumes a stopped one, or finds it done.
    A run folder that another plan file with the same name owns is refused (RunStateError);
    ``force=True`` takes it over for this plan, as ``overbrainer bake --force`` does."""
    from .graph.driver import compile_bake
    from .runtime.run import start_unless_done

    compiled = compile_bake(plan, runs=runs)
    compiled.take_over = force
    handle = start_unless_done(compiled).run
    return handle.wait(show=show) if wait else handle


def run(folder):
    """The run in `folder` (a run folder such as ``runs/demo``)."""
    from .runtime.run import Run

    return Run(folder)


def runs(root=None):
    """Every run under the runs folder (``$OVERBRAINER_RUNS`` or ``./runs``)."""
    from .runtime.run import runs as all_runs

    return all_runs(root)


def __getattr__(name):
    if name == "Run":
        from .runtime.run import Run

        return Run
    if name == "Model":
        from .chat import Model

        return Model
    raise AttributeError(name)
