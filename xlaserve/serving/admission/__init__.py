"""Admission control: accept, queue or reject each request before it reaches an engine."""

from xlaserve.serving.admission.controller import AdmissionController, Rejected, Ticket
from xlaserve.serving.admission.projection import Rates, Work, queue_wait

__all__ = ["AdmissionController", "Rates", "Rejected", "Ticket", "Work", "queue_wait"]
