"""The bake: a plan compiled into a doit task graph, and doit running it.

``driver.py``   compile a plan for its run folder (`compile_bake`), run the graph with doit
                (`run_bake`), and tell what would run (`dry_run`)
``tasks.py``    plan → doit tasks: the one place that knows the order of the steps
``explain.py``  the graph and the reasons, for ``overbrainer graph`` and ``why``

The steps themselves (``steps/``) are handed a `steps.context.Bake`; they never import this
package.
"""
