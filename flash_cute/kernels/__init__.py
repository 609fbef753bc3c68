"""CuTe DSL kernels. ``common`` is shared by every architecture; ``sm90`` holds the Hopper
kernels."""
