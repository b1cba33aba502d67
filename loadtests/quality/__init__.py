"""Answer quality: task sets, checkers and the statistics that turn verdicts into calls."""
