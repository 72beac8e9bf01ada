"""What a stuck or failed job tells: the board, the hang report, stacks, the flight recorder, mismatches."""
