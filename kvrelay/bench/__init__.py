"""kvrelay's own benchmarks (`kvrelay bench ...`): each prints a ratio against a reference it
measures in the same run. Side-by-side runs against other engines are the root bench/."""
