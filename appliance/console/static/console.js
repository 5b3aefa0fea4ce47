// The server writes every time in UTC; show each in the viewer's own time zone, keeping the
// UTC time on hover. Without script the UTC times stay, which is correct, only less handy.
"use strict";
for (const element of document.querySelectorAll("time[datetime]")) {
  const moment = new Date(element.dateTime);
  if (Number.isNaN(moment.getTime())) {
    continue;
  }
  element.title = element.textContent.trim();
  element.textContent = moment.toLocaleString(undefined, {
    year: "numeric", month: "short", day: "numeric",
    hour: "2-digit", minute: "2-digit", second: "2-digit", timeZoneName: "short",
  });
}
