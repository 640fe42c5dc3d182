"""Test reporting for release sign-off.

``regression`` is a pytest plugin (the ``regression`` marker and the JUnit properties it writes).
Everything else reads what runs wrote (JUnit XML through ``junitparser``, the harness's sidecars and
journals) and turns it into the sign-off (``signoff``, the ``harness-signoff`` command): no torch,
no pytest, so it runs wherever the results can be copied to.
"""
