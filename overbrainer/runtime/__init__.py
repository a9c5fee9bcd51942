"""A run at run time: its folder's state (run.json), its own process, following it.

``run.py``      `Run`: state, process, stop/resume, metrics, log and models of a run
                folder; `launch` (a bake in a process of its own), `start_unless_done`
``follow.py``   following a run from another process: a progress bar or lines

(Not ``runs``: that is the public function ``overbrainer.runs()``, which a subpackage of the
same name would shadow.)
"""
