"""Test reporting for release sign-off.

Reads what runs wrote (JUnit XML through ``junitparser``, the harness's sidecars and journals) and
turns it into the sign-off (``signoff``, the ``harness-signoff`` command): no torch, no pytest, so it
runs wherever the results can be copied to. The names it shares with the pytest plugins that write
them are in ``junit_format`` and ``sidecar_format`` (standard library only); the ``regression``
marker's plugin is ``harness.regression_marker``.
"""
