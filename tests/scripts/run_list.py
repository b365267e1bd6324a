"""`a b --next c d` -> [[a, b], [c, d]]: the runs a dump script trains one after another
in the same processes (each builds its own loop, which reseeds every generator)."""


def split_runs(argv: list[str]) -> list[list[str]]:
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--next":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs
