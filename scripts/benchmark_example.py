"""End-to-end LTX-Video benchmark, under the name the seed guide uses: forwards every argument to
scripts/generate_video.py (see its --help).

  python scripts/benchmark_example.py --use-optimized-kernels --compile --batch-size 1 \
      --num-frames 161 --height 512 --width 768 --steps 50 --warmup-iterations 2
  python scripts/benchmark_example.py --compare --num-frames 49 --steps 30
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_video import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(0 if main() else 1)
