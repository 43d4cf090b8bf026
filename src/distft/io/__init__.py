"""Run outputs on disk: atomic files, checkpoints, exports, checks before writing."""
