"""Tests of spec_cli/draft/eagle3/: the EAGLE-3 model, its TTT unroll and its engine writer."""
