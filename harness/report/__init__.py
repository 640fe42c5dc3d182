"""Test reporting for release sign-off.

``regression`` is a pytest plugin (the ``regression`` marker and the JUnit properties it writes),
``junit_read`` reads pytest's JUnit XML, and ``signoff`` (the ``harness-signoff`` command) turns
that XML into a Markdown sign-off report. ``junit_read`` and ``signoff`` use the standard library only.
"""
