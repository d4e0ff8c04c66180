"""The generated admin token is safe to paste after a flag."""

from console.settings import ServerSettings


def test_generated_tokens_can_follow_a_flag():
    """A printed admin token goes after `--admin-token` on a command line: it must never
    begin with "-" (argparse would read it as an option; 1 in 64 raw tokens do)."""
    import argparse

    from console.settings import new_token

    tokens = [new_token() for _ in range(2000)] + [ServerSettings().admin_token]
    assert not any(t.startswith("-") for t in tokens) and len(set(tokens)) == len(tokens)
    p = argparse.ArgumentParser()
    p.add_argument("--admin-token")
    assert all(p.parse_args(["--admin-token", t]).admin_token == t for t in tokens[:200])
