"""Sends a model's weights as the broadcast sender (rank 0): `python send_weights.py MODEL_DIR HOST PORT`.

Run on another host than the receiving replica, it proves that `weights.broadcast` works across hosts:
it rendezvouses at HOST:PORT (HOST is the address it announces), prints "sending", and prints the
transfer's stats as JSON when every receiver has its tensors.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from rlfabric.weights import broadcast


def main(model_dir: str, host: str, port: str) -> None:
    state_dict = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        state_dict.update(load_file(file))
    print("sending", flush=True)
    stats = broadcast.send_state_dict(
        state_dict, host=host, port=int(port), world_size=2, bucket_bytes=1 << 20, timeout_s=120
    )
    print("sent " + json.dumps(stats.to_dict()), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
