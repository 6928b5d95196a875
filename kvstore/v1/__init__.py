"""Generated from proto/kvstore/v1 by scripts/gen_proto.py. Do not edit."""
