"""`python -m hf_qsa_cache.serve PATH [--port ...]`: the same as `hf-qsa-serve` (see `hf_qsa_cache.server.cli`)."""

import sys

from hf_qsa_cache.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
