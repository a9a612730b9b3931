"""PAPO-G step overhead against plain GRPO, side by side on the CPU (see ``papo_nb/bench/``).

    python benchmarks/step_overhead.py [--quick] [--out FILE.json] [--sizes tiny,wide] [--markdown FILE.md]

Also available as ``papo-nb bench`` (same options).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, if papo_nb is not installed

from papo_nb.bench.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
