# Sourced by the venv builders here, after they set REPO: UV, the uv on PATH, else the one the Makefile pins
# (installed into .venv-uv from the package index on first use), so a fresh machine needs nothing installed by hand.
UV="${UV:-$(command -v uv || true)}"
if [ -z "$UV" ]; then
    make -C "$REPO" --no-print-directory .venv-uv/bin/uv
    UV="$REPO/.venv-uv/bin/uv"
fi
