"""Callbacks: one public callback per module."""
