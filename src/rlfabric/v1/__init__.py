"""Generated from proto/rlfabric/v1 by scripts/gen_proto.py. Do not edit."""
