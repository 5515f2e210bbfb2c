"""What the `openai` client scripts (tests/openai_*.py) share: one line per passed check, and an
AssertionError (a non-zero exit) naming the first that fails."""


def check(name, cond, detail=""):
    if not cond:
        raise AssertionError(f"{name}: {detail}")
    print(f"ok   {name}", flush=True)
