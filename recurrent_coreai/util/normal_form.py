"""The normalised checkpoint's file name: what the source stage writes and every later stage reads.

A module of its own, without torch, so that the stages that only name the file (the card) start
without importing torch (util/safetensors_stream.py, which writes it, re-exports it)."""

WEIGHT_FILE = "model.safetensors"
