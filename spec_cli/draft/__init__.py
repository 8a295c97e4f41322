"""The EAGLE-3 draft model, its TTT unroll and losses."""
