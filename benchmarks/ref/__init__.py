"""Reference C UCX ping-pong and its Python runner (see run_ref.py)."""
