"""Tests of spec_cli/draft/eagle/: the EAGLE-1/2 draft and its objective."""
