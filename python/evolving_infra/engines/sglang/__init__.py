"""The symmetric engine on SGLang 0.5.23: launch flags, the in-process patch, launcher, sidecar.

Importing this package imports no SGLang: the router and the sidecar run where SGLang is not
installed, and only `patch.apply()` / `patch.launch_patched_server()` load it.
"""
