"""Admission control: accept, queue or reject each request before it reaches an engine."""

from xlaserve.serving.admission.controller import AdmissionController, Rejected, Ticket

__all__ = ["AdmissionController", "Rejected", "Ticket"]
