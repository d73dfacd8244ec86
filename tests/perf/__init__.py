"""Code the benchmarks and their CPU rehearsals use: FLOPs and MFU, GPU time by stream, a step's profile, the
extraction benchmark's loop, the trainer benchmark's history rows. Not part of the eagle3 package."""
