"""Report sections: each module has TITLE, run(ctx) -> data, markdown(data, ctx) and
optionally plots(data, ctx) -> [png names]; benchmarks/run.py lists them in order."""
