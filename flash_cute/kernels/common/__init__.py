"""Device-side pieces shared by forward/backward and SM90/SM100 kernels."""
