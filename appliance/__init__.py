"""Inferno: the running appliance and its composition root."""
